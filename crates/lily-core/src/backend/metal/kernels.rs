//! The embedded shader sources (compiled at `Engine::new`: `newLibraryWithSource` on a Mac,
//! clang through tools/metal-sim on Linux) and the host name of every kernel, so a typo fails
//! when the backend is built, not mid-generation.

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

/// Kernels instantiated once per weight format as `<family>_<suffix>`.
const PER_WEIGHT: &[&str] = &[
    "matmul_gemv",
    "matmul_gemm",
    "matmul_mma",
    "embed",
    "moe_gate_up",
    "moe_down",
    "moe_gemm_gate_up",
    "moe_gemm_down",
];

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

/// Every kernel host name the backend may dispatch.
pub fn kernel_names() -> Vec<String> {
    let mut v: Vec<String> = F32_ONLY.iter().map(|s| s.to_string()).collect();
    for f in PER_WEIGHT {
        v.extend(WEIGHT_SUFFIXES.iter().map(|s| format!("{f}_{s}")));
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
