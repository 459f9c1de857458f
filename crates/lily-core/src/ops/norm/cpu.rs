//! The norms on the CPU: one pool task per row.

use crate::backend::{
    cpu::{isa::Isa, pool, simd},
    params::RmsNormParams,
};

fn norm_row(isa: Isa, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (simd::dot(isa, x, x) / x.len() as f32 + eps).sqrt();
    for j in 0..x.len() {
        out[j] = x[j] * inv * w[j];
    }
}

/// Row-wise RMSNorm [rows, dim]; one task per row (a single row runs inline).
pub fn rms_norm(p: &RmsNormParams, x: &[f32], w: &[f32], out: &mut [f32]) {
    let (isa, d) = (Isa::get(), p.dim as usize);
    let n = p.rows as usize * d;
    pool::for_chunks(&mut out[..n], d, |r, o| norm_row(isa, &x[r * d..][..d], w, p.eps, o));
}

/// RMSNorm times silu(z), rows of [rows, dim] (rows = tokens x value heads).
pub fn rms_norm_gated(p: &RmsNormParams, x: &[f32], z: &[f32], w: &[f32], out: &mut [f32]) {
    let (isa, d) = (Isa::get(), p.dim as usize);
    let n = p.rows as usize * d;
    let row = |o: &mut [f32], xr: &[f32], zr: &[f32]| {
        norm_row(isa, xr, w, p.eps, o);
        o.iter_mut().zip(zr).for_each(|(v, zz)| *v *= simd::silu(*zz));
    };
    if n <= 1 << 14 {
        // Decode (32 heads x 128): cheaper than a pool round trip.
        for ((o, xr), zr) in out[..n].chunks_mut(d).zip(x[..n].chunks(d)).zip(z[..n].chunks(d)) {
            row(o, xr, zr);
        }
        return;
    }
    pool::for_chunks(&mut out[..n], d, |r, o| row(o, &x[r * d..][..d], &z[r * d..][..d]));
}
