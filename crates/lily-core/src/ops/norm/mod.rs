//! RMSNorm over rows (`RmsNormParams`: `rows` rows of `dim` f32 values):
//! - `rms_norm`: out = x / sqrt(mean(x^2) + eps) * w, x, out [rows, dim], w [dim] (the model
//!   folds HF's 1 + w into w at load);
//! - `rms_norm_gated`: out = rms_norm(x, w) * silu(z), z [rows, dim] (DeltaNet's output norm,
//!   rows = tokens x value heads).
//!
//! The per-head q/k norm of attention is fused with RoPE: `ops::attention` (`qk_norm_rope`).

pub mod cpu;
pub mod cuda;
pub mod metal;
pub mod reference;
