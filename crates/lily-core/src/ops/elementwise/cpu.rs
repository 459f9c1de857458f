//! The elementwise ops on the CPU: runs of 4096 values (add, swiglu) or one row (sigmoid_gate_add)
//! per pool task.

use crate::{
    backend::{
        cpu::{pool, simd},
        params::RowsParams,
    },
    ops::sigmoid,
};

pub fn add(p: &RowsParams, x: &mut [f32], y: &[f32]) {
    let n = (p.tokens * p.dim) as usize;
    pool::for_chunks(&mut x[..n], 4096, |c, a| {
        a.iter_mut().zip(&y[c * 4096..]).for_each(|(u, v)| *u += v)
    });
}

pub fn swiglu(p: &RowsParams, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = (p.tokens * p.dim) as usize;
    pool::for_chunks(&mut out[..n], 4096, |c, o| {
        let (g, u) = (&gate[c * 4096..], &up[c * 4096..]);
        for i in 0..o.len() {
            o[i] = simd::silu(g[i]) * u[i];
        }
    });
}

pub fn sigmoid_gate_add(p: &RowsParams, y: &[f32], gate: &[f32], out: &mut [f32]) {
    let d = p.dim as usize;
    pool::for_chunks(&mut out[..p.tokens as usize * d], d, |t, o| {
        let s = sigmoid(gate[t]);
        o.iter_mut().zip(&y[t * d..][..d]).for_each(|(a, b)| *a += s * b);
    });
}
