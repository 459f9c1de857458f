//! The elementwise ops on CUDA (`shaders/cuda/elementwise.cu`): one thread per value, a block
//! row per token.

use crate::backend::{
    cuda::{kernels::Fixed as F, rows_launch, Args, Cuda, CudaBuf, Executor},
    params::RowsParams,
};

pub fn add<X: Executor>(c: &Cuda<X>, p: &RowsParams, x: &mut CudaBuf<X>, y: &CudaBuf<X>) {
    let n = (p.tokens * p.dim) as usize;
    if !c.fits("add", &[("x", x.len, n), ("y", y.len, n)]) {
        return;
    }
    let args = Args::new().push(*p).ptr(x.ptr()).ptr(y.ptr());
    c.launch(F::Add, rows_launch(p.dim as usize, p.tokens as usize), args);
}

pub fn swiglu<X: Executor>(c: &Cuda<X>, p: &RowsParams, gate: &CudaBuf<X>, up: &CudaBuf<X>, out: &mut CudaBuf<X>) {
    let n = (p.tokens * p.dim) as usize;
    if !c.fits(
        "swiglu",
        &[("gate", gate.len, n), ("up", up.len, n), ("out", out.len, n)],
    ) {
        return;
    }
    let args = Args::new().push(*p).ptr(gate.ptr()).ptr(up.ptr()).ptr(out.ptr());
    c.launch(F::Swiglu, rows_launch(p.dim as usize, p.tokens as usize), args);
}

pub fn sigmoid_gate_add<X: Executor>(
    c: &Cuda<X>,
    p: &RowsParams,
    y: &CudaBuf<X>,
    gate: &CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let n = (p.tokens * p.dim) as usize;
    if !c.fits(
        "sigmoid_gate_add",
        &[
            ("y", y.len, n),
            ("gate", gate.len, p.tokens as usize),
            ("out", out.len, n),
        ],
    ) {
        return;
    }
    let args = Args::new().push(*p).ptr(y.ptr()).ptr(gate.ptr()).ptr(out.ptr());
    c.launch(F::SigmoidGateAdd, rows_launch(p.dim as usize, p.tokens as usize), args);
}

/// dst[dst_off..dst_off + len] = src[src_off..src_off + len], recorded in the stream (bounds checked by
/// the caller): one row of `len` threads, the pointers already at their offsets.
pub fn copy_rows<X: Executor>(
    c: &Cuda<X>,
    src: &CudaBuf<X>,
    src_off: usize,
    dst: &mut CudaBuf<X>,
    dst_off: usize,
    len: usize,
) {
    let p = RowsParams {
        tokens: 1,
        dim: len as u32,
    };
    let args = Args::new()
        .push(p)
        .ptr(src.ptr() + (src_off * 4) as u64)
        .ptr(dst.ptr() + (dst_off * 4) as u64);
    c.launch(F::CopyRows, rows_launch(len, 1), args);
}
