//! The reference twins of the norms (shapes: `ops/norm/mod.rs`).

use crate::{backend::params::RmsNormParams, ops::silu};

pub fn rms_norm(p: &RmsNormParams, x: &[f32], w: &[f32], out: &mut [f32]) {
    let d = p.dim as usize;
    for r in 0..p.rows as usize {
        let row = &x[r * d..(r + 1) * d];
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + p.eps).sqrt();
        for j in 0..d {
            out[r * d + j] = row[j] * inv * w[j];
        }
    }
}

pub fn rms_norm_gated(p: &RmsNormParams, x: &[f32], z: &[f32], w: &[f32], out: &mut [f32]) {
    rms_norm(p, x, w, out);
    for i in 0..(p.rows * p.dim) as usize {
        out[i] *= silu(z[i]);
    }
}
