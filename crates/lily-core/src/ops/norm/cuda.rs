//! The norms on CUDA (`shaders/cuda/rms_norm.cu`): one block of 256 threads per row; the residual
//! add (and the MoE block's gated shared expert) fused with the norm after it (`add_rms_norm`,
//! `add_gated_rms_norm`: one launch instead of two or three).

use crate::backend::{
    cuda::{kernels::Fixed as F, shape, Args, Cuda, CudaBuf, Executor},
    params::RmsNormParams,
};

pub fn rms_norm<X: Executor>(c: &Cuda<X>, p: &RmsNormParams, x: &CudaBuf<X>, w: &CudaBuf<X>, out: &mut CudaBuf<X>) {
    let n = (p.rows * p.dim) as usize;
    if !c.fits(
        "rms_norm",
        &[("x", x.len, n), ("w", w.len, p.dim as usize), ("out", out.len, n)],
    ) {
        return;
    }
    let args = Args::new().push(*p).ptr(x.ptr()).ptr(w.ptr()).ptr(out.ptr());
    c.launch(F::RmsNorm, shape([p.rows, 1, 1], 256), args);
}

pub fn rms_norm_gated<X: Executor>(
    c: &Cuda<X>,
    p: &RmsNormParams,
    x: &CudaBuf<X>,
    z: &CudaBuf<X>,
    w: &CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let n = (p.rows * p.dim) as usize;
    if !c.fits(
        "rms_norm_gated",
        &[
            ("x", x.len, n),
            ("z", z.len, n),
            ("w", w.len, p.dim as usize),
            ("out", out.len, n),
        ],
    ) {
        return;
    }
    let args = Args::new()
        .push(*p)
        .ptr(x.ptr())
        .ptr(z.ptr())
        .ptr(w.ptr())
        .ptr(out.ptr());
    c.launch(F::RmsNormGated, shape([p.rows, 1, 1], 256), args);
}

pub fn add_rms_norm<X: Executor>(
    c: &Cuda<X>,
    p: &RmsNormParams,
    x: &mut CudaBuf<X>,
    y: &CudaBuf<X>,
    w: &CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let n = (p.rows * p.dim) as usize;
    if !c.fits(
        "add_rms_norm",
        &[
            ("x", x.len, n),
            ("y", y.len, n),
            ("w", w.len, p.dim as usize),
            ("out", out.len, n),
        ],
    ) {
        return;
    }
    let args = Args::new()
        .push(*p)
        .ptr(x.ptr())
        .ptr(y.ptr())
        .ptr(w.ptr())
        .ptr(out.ptr());
    c.launch(F::AddRmsNorm, shape([p.rows, 1, 1], 256), args);
}

#[allow(clippy::too_many_arguments)]
pub fn add_gated_rms_norm<X: Executor>(
    c: &Cuda<X>,
    p: &RmsNormParams,
    x: &mut CudaBuf<X>,
    y: &CudaBuf<X>,
    shared: &CudaBuf<X>,
    gate: &CudaBuf<X>,
    w: &CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let n = (p.rows * p.dim) as usize;
    if !c.fits(
        "add_gated_rms_norm",
        &[
            ("x", x.len, n),
            ("y", y.len, n),
            ("shared", shared.len, n),
            ("gate", gate.len, p.rows as usize),
            ("w", w.len, p.dim as usize),
            ("out", out.len, n),
        ],
    ) {
        return;
    }
    let args = Args::new()
        .push(*p)
        .ptr(x.ptr())
        .ptr(y.ptr())
        .ptr(shared.ptr())
        .ptr(gate.ptr())
        .ptr(w.ptr())
        .ptr(out.ptr());
    c.launch(F::AddGatedRmsNorm, shape([p.rows, 1, 1], 256), args);
}
