//! RMSNorm over rows (`RmsNormParams`: `rows` rows of `dim` f32 values):
//! - `rms_norm`: out = x / sqrt(mean(x^2) + eps) * w, x, out [rows, dim], w [dim] (the model
//!   folds HF's 1 + w into w at load);
//! - `rms_norm_gated`: out = rms_norm(x, w) * silu(z), z [rows, dim] (DeltaNet's output norm,
//!   rows = tokens x value heads);
//! - `add_rms_norm`: x += y, then out = rms_norm(x, w) (a residual add and the norm after it);
//! - `add_gated_rms_norm`: x += y + sigmoid(gate[row]) * shared, then out = rms_norm(x, w)
//!   (the MoE block's end: routed sum, gated shared expert, residual, next norm), gate [rows].
//! - `moe_experts_add_rms_norm` (`MoeParams` T, K and the norm's): x += moe_experts(h) +
//!   sigmoid(gate[row]) * shared, then h = rms_norm(x, w): `add_gated_rms_norm` with the routed sum
//!   computed inside. Its reference is its parts (`moe_experts` into a [T, D] scratch, then
//!   `add_gated_rms_norm`); on a GPU a decode step runs the expert GEMVs of `ops::moe` into y
//!   [T*K, D] and one norm kernel that sums each row's K expert rows (k ascending, as
//!   `moe_combine`) into the residual: one dispatch per layer fewer. Tested with the MoE family
//!   (`tests/ops_moe.rs`: it needs expert weights).
//!
//! The per-head q/k norm of attention is fused with RoPE: `ops::attention` (`qk_norm_rope`).

pub mod cpu;
pub mod cuda;
pub mod metal;
pub mod reference;

use crate::backend::{params::RmsNormParams, Backend, GatedAdd};

/// `add_gated_rms_norm`'s buffers in its GPU kernels' argument order (after the params), as (name,
/// buffer, elements needed): x, y, shared, out [rows, dim], gate [rows], w [dim].
pub fn add_gated_bufs<'a, B: Backend>(
    p: &RmsNormParams,
    x: &'a B::Buf,
    add: &GatedAdd<'a, B>,
    w: &'a B::Buf,
    out: &'a B::Buf,
) -> [(&'static str, &'a B::Buf, usize); 6] {
    let (n, d, rows) = ((p.rows * p.dim) as usize, p.dim as usize, p.rows as usize);
    [
        ("x", x, n),
        ("y", add.y, n),
        ("shared", add.shared, n),
        ("gate", add.gate, rows),
        ("w", w, d),
        ("out", out, n),
    ]
}
