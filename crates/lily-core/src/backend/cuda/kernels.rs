//! The embedded CUDA sources (compiled at run time: NVRTC on a GPU, clang through tools/cuda-sim
//! in the simulator) and the name of every kernel, as a table the backend builds once, so a
//! launch finds its function without building a string and a typo fails when the backend is built.

macro_rules! source {
    ($dir:literal, $file:literal) => {
        (
            $file,
            include_str!(concat!("../../../../../shaders/", $dir, "/", $file)),
        )
    };
}

/// The headers the kernels include, by the name they include them with. `shaders/params.h` is the
/// one definition of the op parameter structs and shared constants (with the Metal shaders and
/// `backend/params.rs`).
pub const HEADERS: &[(&str, &str)] = &[
    ("params.h", include_str!("../../../../../shaders/params.h")),
    source!("cuda", "common.cuh"),
];

/// One `.cu` per family of ops (each its own NVRTC program / object).
pub const SOURCES: &[(&str, &str)] = &[
    source!("cuda", "attention.cu"),
    source!("cuda", "delta_net.cu"),
    source!("cuda", "elementwise.cu"),
    source!("cuda", "embed.cu"),
    source!("cuda", "matmul.cu"),
    source!("cuda", "moe.cu"),
    source!("cuda", "rms_norm.cu"),
];

pub use crate::backend::{Weight, WEIGHT_SUFFIXES};

/// Kernels with one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fixed {
    Add,
    AddGatedRmsNorm,
    AddRmsNorm,
    Argmax,
    Attention,
    AttentionPrefill,
    CopyRows,
    DeltaNet,
    DeltaNetConv,
    DeltaNetGated,
    DeltaNetPrep,
    DeltaNetScan,
    KvStore,
    MoeCombine,
    MoeCombineSorted,
    MoeExpertsAddRmsNorm,
    MoeRoute,
    MoeSort,
    QkNormRope,
    QkNormRopeStore,
    RmsNorm,
    RmsNormGated,
    SigmoidGateAdd,
    Swiglu,
}

impl Fixed {
    pub const ALL: &'static [Fixed] = &[
        Fixed::Add,
        Fixed::AddGatedRmsNorm,
        Fixed::AddRmsNorm,
        Fixed::Argmax,
        Fixed::Attention,
        Fixed::AttentionPrefill,
        Fixed::CopyRows,
        Fixed::DeltaNet,
        Fixed::DeltaNetConv,
        Fixed::DeltaNetGated,
        Fixed::DeltaNetPrep,
        Fixed::DeltaNetScan,
        Fixed::KvStore,
        Fixed::MoeCombine,
        Fixed::MoeCombineSorted,
        Fixed::MoeExpertsAddRmsNorm,
        Fixed::MoeRoute,
        Fixed::MoeSort,
        Fixed::QkNormRope,
        Fixed::QkNormRopeStore,
        Fixed::RmsNorm,
        Fixed::RmsNormGated,
        Fixed::SigmoidGateAdd,
        Fixed::Swiglu,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Fixed::Add => "add",
            Fixed::AddGatedRmsNorm => "add_gated_rms_norm",
            Fixed::AddRmsNorm => "add_rms_norm",
            Fixed::Argmax => "argmax",
            Fixed::Attention => "attention",
            Fixed::AttentionPrefill => "attention_prefill",
            Fixed::CopyRows => "copy_rows",
            Fixed::DeltaNet => "delta_net",
            Fixed::DeltaNetConv => "delta_net_conv",
            Fixed::DeltaNetGated => "delta_net_gated",
            Fixed::DeltaNetPrep => "delta_net_prep",
            Fixed::DeltaNetScan => "delta_net_scan",
            Fixed::KvStore => "kv_store",
            Fixed::MoeCombine => "moe_combine",
            Fixed::MoeCombineSorted => "moe_combine_sorted",
            Fixed::MoeExpertsAddRmsNorm => "moe_experts_add_rms_norm",
            Fixed::MoeRoute => "moe_route",
            Fixed::MoeSort => "moe_sort",
            Fixed::QkNormRope => "qk_norm_rope",
            Fixed::QkNormRopeStore => "qk_norm_rope_store",
            Fixed::RmsNorm => "rms_norm",
            Fixed::RmsNormGated => "rms_norm_gated",
            Fixed::SigmoidGateAdd => "sigmoid_gate_add",
            Fixed::Swiglu => "swiglu",
        }
    }
}

/// Kernels with one instance per weight format, named `<op>_<suffix>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightOp {
    Embed,
    MatmulGemv,
    MatmulGemvMulti,
    MatmulMma,
    MoeRouter,
    MoeGateUp,
    GateUpSwiglu,
    MoeDown,
    MoeGemmGateUp,
    MoeGemmDown,
}

impl WeightOp {
    pub const ALL: &'static [WeightOp] = &[
        WeightOp::Embed,
        WeightOp::MatmulGemv,
        WeightOp::MatmulGemvMulti,
        WeightOp::MatmulMma,
        WeightOp::MoeRouter,
        WeightOp::MoeGateUp,
        WeightOp::GateUpSwiglu,
        WeightOp::MoeDown,
        WeightOp::MoeGemmGateUp,
        WeightOp::MoeGemmDown,
    ];
    pub fn name(self) -> &'static str {
        match self {
            WeightOp::Embed => "embed",
            WeightOp::MatmulGemv => "matmul_gemv",
            WeightOp::MatmulGemvMulti => "matmul_gemv_multi",
            WeightOp::MatmulMma => "matmul_mma",
            WeightOp::MoeRouter => "moe_router",
            WeightOp::MoeGateUp => "moe_gate_up",
            WeightOp::GateUpSwiglu => "gate_up_swiglu",
            WeightOp::MoeDown => "moe_down",
            WeightOp::MoeGemmGateUp => "moe_gemm_gate_up",
            WeightOp::MoeGemmDown => "moe_gemm_down",
        }
    }
}

const FIXED_END: usize = Fixed::ALL.len();
const N_WEIGHTS: usize = WEIGHT_SUFFIXES.len();

/// A kernel as its place in the table of every kernel (`Kernel::all`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel(u16);

impl Kernel {
    pub const COUNT: usize = FIXED_END + WeightOp::ALL.len() * N_WEIGHTS;

    pub fn fixed(f: Fixed) -> Kernel {
        Kernel(f as u16)
    }
    pub fn weight(op: WeightOp, w: Weight) -> Kernel {
        Kernel((FIXED_END + op as usize * N_WEIGHTS + w.index()) as u16)
    }
    pub fn index(self) -> usize {
        self.0 as usize
    }
    pub fn all() -> impl Iterator<Item = Kernel> {
        (0..Kernel::COUNT).map(|i| Kernel(i as u16))
    }
    /// The kernel's name in the sources (built: for construction and messages).
    pub fn name(self) -> String {
        let i = self.index();
        if i < FIXED_END {
            return Fixed::ALL[i].name().to_string();
        }
        let j = i - FIXED_END;
        format!(
            "{}_{}",
            WeightOp::ALL[j / N_WEIGHTS].name(),
            WEIGHT_SUFFIXES[j % N_WEIGHTS]
        )
    }
}

impl From<Fixed> for Kernel {
    fn from(f: Fixed) -> Kernel {
        Kernel::fixed(f)
    }
}

/// Every kernel name, in table order.
pub fn kernel_names() -> Vec<String> {
    Kernel::all().map(Kernel::name).collect()
}

pub use crate::backend::simlib::Fnv;

/// The sources NVRTC compiles: the embedded ones, or, for kernel development on a GPU machine,
/// the files of the folder `LILY_CUDA_SOURCES` names (a copy of `shaders/`: `params.h` and
/// `cuda/<file>` for every header and source above), so a changed kernel runs without a new
/// build of the package. Only kernels' bodies may differ: the host still launches the kernels
/// of this build with its argument layouts.
pub struct Sources {
    pub headers: Vec<(&'static str, String)>,
    pub files: Vec<(&'static str, String)>,
}

impl Sources {
    pub fn load() -> crate::error::Result<Sources> {
        let dir = std::env::var_os("LILY_CUDA_SOURCES").filter(|d| !d.is_empty());
        Sources::from(dir.as_deref().map(std::path::Path::new))
    }

    /// The embedded sources (`None`), or those of a folder laid out as `shaders/`.
    pub fn from(dir: Option<&std::path::Path>) -> crate::error::Result<Sources> {
        let own = |list: &[(&'static str, &str)]| list.iter().map(|&(n, s)| (n, s.to_string())).collect();
        let Some(dir) = dir else {
            return Ok(Sources {
                headers: own(HEADERS),
                files: own(SOURCES),
            });
        };
        let read = |list: &[(&'static str, &str)]| -> crate::error::Result<Vec<(&'static str, String)>> {
            list.iter()
                .map(|&(n, _)| {
                    let path = if n == "params.h" {
                        dir.join(n)
                    } else {
                        dir.join("cuda").join(n)
                    };
                    std::fs::read_to_string(&path)
                        .map(|s| (n, s))
                        .map_err(|e| crate::error::Error::Device(format!("LILY_CUDA_SOURCES: {}: {e}", path.display())))
                })
                .collect()
        };
        Ok(Sources {
            headers: read(HEADERS)?,
            files: read(SOURCES)?,
        })
    }

    /// The hash of every source and header (part of every compiled-kernel cache key).
    pub fn hash(&self) -> Fnv {
        let mut h = Fnv::new();
        for (n, s) in self.headers.iter().chain(&self.files) {
            h.add(n.as_bytes());
            h.add(s.as_bytes());
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder of the same files hashes as the embedded sources; a missing file is an error
    /// that names it.
    #[test]
    fn sources_from_a_folder() {
        let shaders = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shaders");
        let embedded = Sources::from(None).unwrap();
        assert_eq!(Sources::from(Some(&shaders)).unwrap().hash().0, embedded.hash().0);
        let err = Sources::from(Some(std::path::Path::new("/nonexistent-lily")))
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent-lily/params.h"), "{err}");
    }

    /// Every kernel of the table is defined in the sources: written out (`extern "C" __global__`
    /// ... `name(`) or instantiated per weight format by a macro (`<op>_##sfx(`).
    #[test]
    fn every_kernel_is_in_the_sources() {
        let src: String = SOURCES.iter().map(|(_, s)| *s).collect();
        for &f in Fixed::ALL {
            assert!(src.contains(&format!(" {}(", f.name())), "{} not defined", f.name());
        }
        for &op in WeightOp::ALL {
            assert!(
                src.contains(&format!(" {}_##sfx(", op.name())),
                "{} not instantiated",
                op.name()
            );
        }
        let names = kernel_names();
        let unique: std::collections::HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), Kernel::COUNT);
        assert_eq!(
            Kernel::weight(WeightOp::MoeDown, Weight::from_suffix("q4_bf16").unwrap()).name(),
            "moe_down_q4_bf16"
        );
        assert_eq!(Kernel::fixed(Fixed::Swiglu).name(), "swiglu");
    }
}
