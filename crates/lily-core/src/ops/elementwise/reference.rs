//! The reference twins of the elementwise ops (shapes: `ops/elementwise/mod.rs`).

use crate::{
    backend::params::RowsParams,
    ops::{sigmoid, silu},
};

pub fn add(p: &RowsParams, x: &mut [f32], y: &[f32]) {
    for i in 0..(p.tokens * p.dim) as usize {
        x[i] += y[i];
    }
}

pub fn swiglu(p: &RowsParams, gate: &[f32], up: &[f32], out: &mut [f32]) {
    for i in 0..(p.tokens * p.dim) as usize {
        out[i] = silu(gate[i]) * up[i];
    }
}

pub fn sigmoid_gate_add(p: &RowsParams, y: &[f32], gate: &[f32], out: &mut [f32]) {
    let d = p.dim as usize;
    for t in 0..p.tokens as usize {
        let s = sigmoid(gate[t]);
        for j in 0..d {
            out[t * d + j] += s * y[t * d + j];
        }
    }
}
