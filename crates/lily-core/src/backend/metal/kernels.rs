//! The embedded shader sources (compiled at `Engine::new`: `newLibraryWithSource` on a Mac,
//! clang through tools/metal-sim on Linux) and the host name of every kernel, so a typo fails
//! when the backend is built, not mid-generation. Also the one table of kernel variants by GPU
//! family ([`Variants::for_family`]).

use super::executor::GpuFamily;

macro_rules! shader {
    ($file:literal) => {
        ($file, include_str!(concat!("../../../../../shaders/metal/", $file)))
    };
}

/// Headers first, then one `.metal` per family of ops.
pub const SOURCES: &[(&str, &str)] = &[
    shader!("params.h"),
    shader!("common.h"),
    shader!("attention.metal"),
    shader!("delta_net.metal"),
    shader!("elementwise.metal"),
    shader!("embed.metal"),
    shader!("matmul.metal"),
    shader!("moe.metal"),
    shader!("rms_norm.metal"),
    shader!("rope.metal"),
];

/// Host-name suffixes of the weight formats (`FOR_EACH_WEIGHT` in common.h).
pub const WEIGHT_SUFFIXES: &[&str] = &[
    "f32", "f16", "bf16", "q2_bf16", "q4_bf16", "q8_bf16", "q2_f16", "q4_f16", "q8_f16", "q2_f32", "q4_f32", "q8_f32",
];

/// Kernels instantiated once per weight format as `<op>_<suffix>`.
const PER_WEIGHT: &[&str] = &["matmul_gemm", "embed"];

/// Decode GEMV kernels, instantiated per weight format and rows-per-simdgroup variant as
/// `<op>_<suffix>_r<R>` (`rows_dot` in common.h).
pub const GEMV_OPS: &[&str] = &["matmul_gemv", "moe_gate_up", "moe_down"];

/// Prefill GEMM kernels on simdgroup matrices, instantiated per weight format and tile variant
/// as `<op>_<suffix>_n<TN>`.
pub const GEMM_OPS: &[&str] = &["matmul_mma", "moe_gemm_gate_up", "moe_gemm_down"];

/// Rows of W per simdgroup of the decode GEMV kernels (`GEMV_OPS`; 4 simdgroups, 128 threads
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

/// Rows of W per threadgroup tile of the prefill GEMMs (`GEMM_OPS`; tiles of 32 tokens x TN
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

    /// The host name of GEMV op `op` (one of `GEMV_OPS`) for weight suffix `w`.
    pub fn gemv_name(&self, op: &str, w: &str) -> String {
        format!("{op}_{w}_{}", self.gemv.suffix())
    }

    /// The host name of GEMM op `op` (one of `GEMM_OPS`) for weight suffix `w`.
    pub fn gemm_name(&self, op: &str, w: &str) -> String {
        format!("{op}_{w}_{}", self.gemm.suffix())
    }

    /// The host names of the kernels these variants dispatch (for every weight format).
    pub fn kernel_names(&self) -> Vec<String> {
        let mut v = Vec::new();
        for w in WEIGHT_SUFFIXES {
            v.extend(GEMV_OPS.iter().map(|op| self.gemv_name(op, w)));
            v.extend(GEMM_OPS.iter().map(|op| self.gemm_name(op, w)));
        }
        v
    }
}

/// Kernels instantiated once (f32 activations, u32 routing indices).
const F32_ONLY: &[&str] = &[
    "add_f32",
    "attention_f32",
    "attention_reduce_f32",
    "delta_net_chunk_f32",
    "delta_net_chunk_prep_f32",
    "delta_net_conv_f32",
    "delta_net_f32",
    "kv_store_f32",
    "moe_combine_f32",
    "moe_combine_sorted_f32",
    "moe_histogram_u32",
    "moe_route_f32",
    "moe_scan_u32",
    "moe_scatter_u32",
    "qk_norm_rope_f32",
    "rms_norm_f32",
    "rms_norm_gated_f32",
    "sigmoid_gate_add_f32",
    "swiglu_f32",
];

/// The host names of the kernels that have no GPU-family variants.
pub fn common_kernel_names() -> Vec<String> {
    let mut v: Vec<String> = F32_ONLY.iter().map(|s| s.to_string()).collect();
    for f in PER_WEIGHT {
        v.extend(WEIGHT_SUFFIXES.iter().map(|s| format!("{f}_{s}")));
    }
    v
}

/// Every kernel host name the backend may dispatch: the common kernels and every variant.
pub fn kernel_names() -> Vec<String> {
    let mut v = common_kernel_names();
    for w in WEIGHT_SUFFIXES {
        for r in GemvRows::ALL {
            v.extend(GEMV_OPS.iter().map(|op| format!("{op}_{w}_{}", r.suffix())));
        }
        for t in GemmTile::ALL {
            v.extend(GEMM_OPS.iter().map(|op| format!("{op}_{w}_{}", t.suffix())));
        }
    }
    v
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
        for op in GEMV_OPS.iter().chain(GEMM_OPS) {
            for tile in ["r2", "r4", "n32", "n64"] {
                let needle = format!("{op}_##sfx##_{tile},");
                let is_gemv = GEMV_OPS.contains(op);
                let expected = is_gemv == tile.starts_with('r');
                assert_eq!(src.contains(&needle), expected, "{needle}");
            }
        }
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
