//! The embedded shader sources (compiled at `Engine::new`: `newLibraryWithSource` on a Mac,
//! clang through tools/metal-sim on Linux) and the host name of every kernel, so a typo fails
//! when the backend is built, not mid-generation. Also the one table of kernel variants by GPU
//! family ([`Variants::for_family`]).

use super::executor::GpuFamily;

/// The Metal Shading Language version the shaders are compiled as (`MTLCompileOptions.
/// languageVersion`, set explicitly), and the oldest macOS that has it: MSL 3.0 came with
/// macOS 13. The shaders read bf16 as bits (common.h) rather than with the `bfloat` type of MSL
/// 3.1 (macOS 14); `scripts/check_metal.sh` type-checks them in a mode where `bfloat` does not
/// exist, and the macOS workflow compiles them with Apple's compiler at `-std=metal3.0`.
pub const MSL_VERSION: (u32, u32) = (3, 0);
pub const MIN_MACOS: (u32, u32) = (13, 0);

macro_rules! shader {
    ($file:literal) => {
        ($file, include_str!(concat!("../../../../../shaders/metal/", $file)))
    };
}

/// Headers first (`params.h` is shared with the host and the other GPU backends, so it sits in
/// `shaders/` itself), then one `.metal` per family of ops.
pub const SOURCES: &[(&str, &str)] = &[
    ("params.h", include_str!("../../../../../shaders/params.h")),
    shader!("common.h"),
    shader!("attention.metal"),
    shader!("delta_net.metal"),
    shader!("elementwise.metal"),
    shader!("embed.metal"),
    shader!("matmul.metal"),
    shader!("moe.metal"),
    shader!("norm.metal"),
];

pub use crate::backend::{Weight, WEIGHT_SUFFIXES};

/// An enum of kernels (or kernel families) and their host names (stems), in table order.
macro_rules! kernel_enum {
    ($(#[$meta:meta])* $name:ident { $($v:ident = $s:literal,)* }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($v,)*
        }
        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$v,)*];
            /// The host name (of a family: the stem before the weight suffix).
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$v => $s,)*
                }
            }
        }
    };
}

kernel_enum!(
    /// Kernels instantiated once (f32 activations, u32 routing indices).
    Fixed {
        Add = "add_f32",
        AddGatedRmsNorm = "add_gated_rms_norm_f32",
        AddRmsNorm = "add_rms_norm_f32",
        AttentionF32 = "attention_f32",
        AttentionBf16 = "attention_bf16",
        AttentionF16 = "attention_f16",
        AttentionReduce = "attention_reduce_f32",
        CopyRows = "copy_rows_f32",
        DeltaNetChunk = "delta_net_chunk_f32",
        DeltaNetChunkPrep = "delta_net_chunk_prep_f32",
        DeltaNetConv = "delta_net_conv_f32",
        DeltaNet = "delta_net_f32",
        DeltaNetGated = "delta_net_gated_f32",
        KvStoreF32 = "kv_store_f32",
        KvStoreBf16 = "kv_store_bf16",
        KvStoreF16 = "kv_store_f16",
        MoeCombine = "moe_combine_f32",
        MoeExpertsAddRmsNorm = "moe_experts_add_rms_norm_f32",
        MoeCombineSorted = "moe_combine_sorted_f32",
        MoeHistogram = "moe_histogram_u32",
        MoeRoute = "moe_route_f32",
        MoeScan = "moe_scan_u32",
        MoeScatter = "moe_scatter_u32",
        QkNormRope = "qk_norm_rope_f32",
        QkNormRopeStoreF32 = "qk_norm_rope_store_f32",
        QkNormRopeStoreBf16 = "qk_norm_rope_store_bf16",
        QkNormRopeStoreF16 = "qk_norm_rope_store_f16",
        RmsNorm = "rms_norm_f32",
        RmsNormGated = "rms_norm_gated_f32",
        SigmoidGateAdd = "sigmoid_gate_add_f32",
        Swiglu = "swiglu_f32",
    }
);

kernel_enum!(
    /// Kernels instantiated once per weight format as `<op>_<suffix>`.
    WeightOp {
        MatmulGemm = "matmul_gemm",
        Embed = "embed",
    }
);

kernel_enum!(
    /// Decode GEMV kernels, instantiated per weight format and rows-per-simdgroup variant as
    /// `<op>_<suffix>_r<R>` (`rows_dot` in common.h).
    GemvOp {
        MatmulGemv = "matmul_gemv",
        MoeRouter = "moe_router",
        MoeGateUp = "moe_gate_up",
        GateUpSwiglu = "gate_up_swiglu",
        MoeDown = "moe_down",
    }
);

kernel_enum!(
    /// Prefill GEMM kernels on simdgroup matrices, instantiated per weight format and tile
    /// variant as `<op>_<suffix>_n<TN>`.
    GemmOp {
        MatmulMma = "matmul_mma",
        MoeGemmGateUp = "moe_gemm_gate_up",
        MoeGemmDown = "moe_gemm_down",
    }
);

/// Rows of W per simdgroup of the decode GEMV kernels (`GemvOp`; 4 simdgroups, 128 threads
/// per threadgroup, so 4 R rows per threadgroup).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemvRows {
    R2,
    R4,
}

impl GemvRows {
    pub const ALL: [GemvRows; 2] = [GemvRows::R2, GemvRows::R4];
    pub fn rows(self) -> usize {
        match self {
            GemvRows::R2 => 2,
            GemvRows::R4 => 4,
        }
    }
    /// Host-name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            GemvRows::R2 => "r2",
            GemvRows::R4 => "r4",
        }
    }
}

/// Rows of W per threadgroup tile of the prefill GEMMs (`GemmOp`; tiles of 32 tokens x TN
/// rows, 128 threads; threadgroup memory 4 KiB of x plus TN x 32 floats per weight tile).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmTile {
    N32,
    N64,
}

impl GemmTile {
    pub const ALL: [GemmTile; 2] = [GemmTile::N32, GemmTile::N64];
    pub fn rows(self) -> usize {
        match self {
            GemmTile::N32 => 32,
            GemmTile::N64 => 64,
        }
    }
    /// Host-name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            GemmTile::N32 => "n32",
            GemmTile::N64 => "n64",
        }
    }
}

/// The kernel variants one backend dispatches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Variants {
    pub gemv: GemvRows,
    pub gemm: GemmTile,
}

impl Variants {
    /// The one table of kernel variants by GPU family. Every variant sums each output in the
    /// same order (the same bits in the simulator) and runs on every family; the family only
    /// decides speed.
    ///
    /// | family | chips | GEMV rows / simdgroup (rows / threadgroup) | GEMM tile (tokens x rows) |
    /// |---|---|---|---|
    /// | Apple7 | M1 | 2 (8) | 32 x 32 |
    /// | Apple8 | M2 | 2 (8) | 32 x 32 |
    /// | Apple9 | M3, M4 | 4 (16) | 32 x 64 |
    /// | Apple10 | M5 | 4 (16) | 32 x 64 |
    ///
    /// Why: on Apple7/8 a kernel's registers and threadgroup memory are reserved for its
    /// worst case when a threadgroup launches, so occupancy (the simdgroups a core keeps in
    /// flight to hide memory latency) falls as a kernel grows: 2 rows per simdgroup (2 weight
    /// loads in flight per lane, 2 accumulators) and 8 KiB tiles (4 simdgroup-matrix
    /// accumulators per simdgroup) keep the kernels small. Apple9's dynamic caching allocates
    /// registers and threadgroup memory as the shader runs, so the larger variants cost little
    /// occupancy there and buy: in the GEMV, 4 independent weight loads in flight per lane and
    /// each x chunk reused for 4 rows (decode is memory-bound: more requests in flight is what
    /// reaches the bandwidth); in the GEMM, each staged x tile serves 64 weight rows instead of
    /// 32, halving x staging per weight, at 8 accumulators per simdgroup (16 in the expert
    /// gate/up GEMM) and 12-20 KiB of threadgroup memory. Apple10 inherits Apple9's choice.
    /// These choices follow the occupancy rules of Apple's Metal guides and what MLX and
    /// llama.cpp do on these GPUs; they have not been timed on each chip by Lily yet (no Mac
    /// in CI). `LILY_METAL_FAMILY=7..10` picks another family's row of this table.
    pub fn for_family(family: GpuFamily) -> Variants {
        match family {
            GpuFamily::Apple7 | GpuFamily::Apple8 => Variants {
                gemv: GemvRows::R2,
                gemm: GemmTile::N32,
            },
            GpuFamily::Apple9 | GpuFamily::Apple10 => Variants {
                gemv: GemvRows::R4,
                gemm: GemmTile::N64,
            },
        }
    }

    /// The GEMV kernel `op` for weight format `w`, in these variants.
    pub fn gemv_kernel(&self, op: GemvOp, w: Weight) -> Kernel {
        Kernel::gemv(op, w, self.gemv)
    }

    /// The GEMM kernel `op` for weight format `w`, in these variants.
    pub fn gemm_kernel(&self, op: GemmOp, w: Weight) -> Kernel {
        Kernel::gemm(op, w, self.gemm)
    }

    /// The kernels that read weights of format `w`, in these variants: what a checkpoint with
    /// matrices of that format needs.
    pub fn kernels_for(&self, w: Weight) -> impl Iterator<Item = Kernel> + '_ {
        let per_weight = WeightOp::ALL.iter().map(move |&op| Kernel::per_weight(op, w));
        let gemv = GemvOp::ALL.iter().map(move |&op| self.gemv_kernel(op, w));
        let gemm = GemmOp::ALL.iter().map(move |&op| self.gemm_kernel(op, w));
        per_weight.chain(gemv).chain(gemm)
    }

    /// The host names of the kernels these variants dispatch (for every weight format).
    pub fn kernel_names(&self) -> Vec<String> {
        Weight::all()
            .flat_map(|w| self.kernels_for(w))
            .map(Kernel::name)
            .collect()
    }
}

const N_WEIGHTS: usize = WEIGHT_SUFFIXES.len();
/// Where each group of the kernel table ends: fixed kernels, per-weight kernels, GEMV variants,
/// GEMM variants (= every kernel).
const FIXED_END: usize = Fixed::ALL.len();
const WEIGHT_END: usize = FIXED_END + WeightOp::ALL.len() * N_WEIGHTS;
const GEMV_END: usize = WEIGHT_END + GemvOp::ALL.len() * N_WEIGHTS * GemvRows::ALL.len();
const KERNELS: usize = GEMV_END + GemmOp::ALL.len() * N_WEIGHTS * GemmTile::ALL.len();

/// One kernel host name, as its place in the table of every kernel the backend may dispatch
/// (`Kernel::all`, in the order of [`kernel_names`]): the backend holds one pipeline and one name
/// per place, built at construction, so a dispatch finds both without building a string.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel(u16);

impl Kernel {
    /// The number of kernels (table places).
    pub const COUNT: usize = KERNELS;

    pub fn fixed(f: Fixed) -> Kernel {
        Kernel(f as u16)
    }
    pub fn per_weight(op: WeightOp, w: Weight) -> Kernel {
        Kernel((FIXED_END + op as usize * N_WEIGHTS + w.index()) as u16)
    }
    pub fn gemv(op: GemvOp, w: Weight, rows: GemvRows) -> Kernel {
        let n = GemvRows::ALL.len();
        Kernel((WEIGHT_END + (op as usize * N_WEIGHTS + w.index()) * n + rows as usize) as u16)
    }
    pub fn gemm(op: GemmOp, w: Weight, tile: GemmTile) -> Kernel {
        let n = GemmTile::ALL.len();
        Kernel((GEMV_END + (op as usize * N_WEIGHTS + w.index()) * n + tile as usize) as u16)
    }

    /// Its place in the table (0 .. `Kernel::COUNT`).
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// Every kernel, in table order.
    pub fn all() -> impl Iterator<Item = Kernel> {
        (0..KERNELS).map(|i| Kernel(i as u16))
    }

    /// The host name `<op>[_<weight>][_<variant>]` (built: for construction and messages).
    pub fn name(self) -> String {
        let i = self.index();
        if i < FIXED_END {
            return Fixed::ALL[i].name().to_string();
        }
        if i < WEIGHT_END {
            let j = i - FIXED_END;
            return format!(
                "{}_{}",
                WeightOp::ALL[j / N_WEIGHTS].name(),
                WEIGHT_SUFFIXES[j % N_WEIGHTS]
            );
        }
        if i < GEMV_END {
            let (j, n) = (i - WEIGHT_END, GemvRows::ALL.len());
            let (op, w, r) = (j / n / N_WEIGHTS, j / n % N_WEIGHTS, j % n);
            return format!(
                "{}_{}_{}",
                GemvOp::ALL[op].name(),
                WEIGHT_SUFFIXES[w],
                GemvRows::ALL[r].suffix()
            );
        }
        let (j, n) = (i - GEMV_END, GemmTile::ALL.len());
        let (op, w, t) = (j / n / N_WEIGHTS, j / n % N_WEIGHTS, j % n);
        format!(
            "{}_{}_{}",
            GemmOp::ALL[op].name(),
            WEIGHT_SUFFIXES[w],
            GemmTile::ALL[t].suffix()
        )
    }
}

impl From<Fixed> for Kernel {
    fn from(f: Fixed) -> Kernel {
        Kernel::fixed(f)
    }
}

/// Every kernel host name the backend may dispatch: the common kernels and every variant, in
/// table order (`Kernel::index`).
pub fn kernel_names() -> Vec<String> {
    Kernel::all().map(Kernel::name).collect()
}

/// The `.metal` files (not the headers).
pub fn metal_files() -> impl Iterator<Item = (&'static str, &'static str)> {
    SOURCES.iter().copied().filter(|(n, _)| n.ends_with(".metal"))
}

/// The source of `.metal` file `file` as one self-contained string, for `newLibraryWithSource`
/// (which has no include path): each `#include "x.h"` of a header in [`SOURCES`] is replaced by
/// that header, once per string (their `#pragma once` dropped), with `#line` markers so
/// compiler messages still name the original file and line. `<...>` includes stay.
pub fn standalone(file: &str, src: &str) -> String {
    fn expand(file: &str, src: &str, seen: &mut Vec<String>, out: &mut String) {
        out.push_str(&format!("#line 1 \"{file}\"\n"));
        for (i, line) in src.lines().enumerate() {
            let t = line.trim();
            if t == "#pragma once" {
                out.push('\n');
                continue;
            }
            let local = t
                .strip_prefix("#include")
                .map(str::trim)
                .and_then(|r| r.strip_prefix('"'))
                .and_then(|r| r.strip_suffix('"'));
            match local.and_then(|name| SOURCES.iter().find(|(n, _)| *n == name)) {
                Some((name, body)) => {
                    if !seen.iter().any(|s| s == name) {
                        seen.push(name.to_string());
                        expand(name, body, seen, out);
                    }
                    out.push_str(&format!("#line {} \"{file}\"\n", i + 2));
                }
                None => {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
    }
    let mut out = String::new();
    expand(file, src, &mut Vec::new(), &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_picks_existing_kernels() {
        let all = kernel_names();
        for f in GpuFamily::ALL {
            for name in Variants::for_family(f).kernel_names() {
                assert!(all.contains(&name), "{f}: {name} is not a kernel");
            }
        }
        // Every variant is some family's choice (no instantiation only the tests run).
        let picked: Vec<Variants> = GpuFamily::ALL.into_iter().map(Variants::for_family).collect();
        for r in GemvRows::ALL {
            assert!(picked.iter().any(|v| v.gemv == r), "{r:?} is picked by no family");
        }
        for t in GemmTile::ALL {
            assert!(picked.iter().any(|v| v.gemm == t), "{t:?} is picked by no family");
        }
        let unique: std::collections::HashSet<&String> = all.iter().collect();
        assert_eq!(unique.len(), all.len(), "duplicate host names");
    }

    /// Every host name of the variant kernels appears in the shaders' INSTANTIATE lines.
    #[test]
    fn variant_names_are_instantiated() {
        let src: String = metal_files().map(|(_, s)| s).collect();
        let gemv = GemvOp::ALL.iter().map(|o| (o.name(), true));
        for (op, is_gemv) in gemv.chain(GemmOp::ALL.iter().map(|o| (o.name(), false))) {
            for tile in ["r2", "r4", "n32", "n64"] {
                let needle = format!("{op}_##sfx##_{tile},");
                let expected = is_gemv == tile.starts_with('r');
                assert_eq!(src.contains(&needle), expected, "{needle}");
            }
        }
    }

    /// The kernel table: every place has its own host name, the constructors land on the place
    /// whose name they mean, and the names are those of the shaders' naming scheme.
    #[test]
    fn kernel_table_round_trips() {
        let names = kernel_names();
        assert_eq!(names.len(), Kernel::COUNT);
        for (i, k) in Kernel::all().enumerate() {
            assert_eq!(k.index(), i);
            assert_eq!(k.name(), names[i]);
        }
        let mut want = Vec::new();
        for &f in Fixed::ALL {
            assert_eq!(Kernel::fixed(f).name(), f.name());
            want.push(f.name().to_string());
        }
        for w in Weight::all() {
            assert_eq!(Weight::from_suffix(w.suffix()), Some(w));
            for &op in WeightOp::ALL {
                let name = format!("{}_{}", op.name(), w.suffix());
                assert_eq!(Kernel::per_weight(op, w).name(), name);
                want.push(name);
            }
            for &op in GemvOp::ALL {
                for r in GemvRows::ALL {
                    let name = format!("{}_{}_{}", op.name(), w.suffix(), r.suffix());
                    assert_eq!(Kernel::gemv(op, w, r).name(), name);
                    want.push(name);
                }
            }
            for &op in GemmOp::ALL {
                for t in GemmTile::ALL {
                    let name = format!("{}_{}_{}", op.name(), w.suffix(), t.suffix());
                    assert_eq!(Kernel::gemm(op, w, t).name(), name);
                    want.push(name);
                }
            }
        }
        want.sort();
        let mut got = names.clone();
        got.sort();
        assert_eq!(got, want, "the table holds exactly the kernels of the naming scheme");
        assert_eq!(Weight::from_suffix("q3_bf16"), None);
        assert_eq!(Kernel::fixed(Fixed::MoeRoute).name(), "moe_route_f32");
    }

    #[test]
    fn standalone_sources_have_no_local_includes() {
        for (file, src) in metal_files() {
            let s = standalone(file, src);
            assert!(!s.contains("#include \""), "{file}: a local include is left");
            assert!(!s.contains("#pragma once"), "{file}");
            assert_eq!(
                s.matches("struct MatmulParams").count(),
                1,
                "{file}: params.h inlined once"
            );
        }
    }
}
