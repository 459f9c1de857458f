//! The norms on CUDA (`shaders/cuda/rms_norm.cu`): one block of 256 threads per row; the residual
//! add (and the MoE block's gated shared expert) fused with the norm after it (`add_rms_norm`,
//! `add_gated_rms_norm`: one launch instead of two or three).

use crate::backend::{
    cuda::{kernels::Fixed as F, shape, Args, Cuda, CudaBuf, Executor},
    params::RmsNormParams,
};

/// Launch a norm kernel over `p.rows` rows (one block of 256 threads per row) after checking
/// each buffer's length: `bufs` are (name, buffer, elements needed) in the kernel's argument order.
fn row_norm<X: Executor>(c: &Cuda<X>, op: &str, kernel: F, p: &RmsNormParams, bufs: &[(&str, &CudaBuf<X>, usize)]) {
    let mut checks = [("", 0, 0); 6]; // no allocation: encoders run inside the decode loop
    for (check, &(name, b, need)) in checks.iter_mut().zip(bufs) {
        *check = (name, b.len, need);
    }
    if !c.fits(op, &checks[..bufs.len()]) {
        return;
    }
    let args = bufs
        .iter()
        .fold(Args::new().push(*p), |args, (_, b, _)| args.ptr(b.ptr()));
    c.launch(kernel, shape([p.rows, 1, 1], 256), args);
}

pub fn rms_norm<X: Executor>(c: &Cuda<X>, p: &RmsNormParams, x: &CudaBuf<X>, w: &CudaBuf<X>, out: &mut CudaBuf<X>) {
    let (n, d) = ((p.rows * p.dim) as usize, p.dim as usize);
    row_norm(
        c,
        "rms_norm",
        F::RmsNorm,
        p,
        &[("x", x, n), ("w", w, d), ("out", out, n)],
    );
}

pub fn rms_norm_gated<X: Executor>(
    c: &Cuda<X>,
    p: &RmsNormParams,
    x: &CudaBuf<X>,
    z: &CudaBuf<X>,
    w: &CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let (n, d) = ((p.rows * p.dim) as usize, p.dim as usize);
    let bufs = [("x", x, n), ("z", z, n), ("w", w, d), ("out", &*out, n)];
    row_norm(c, "rms_norm_gated", F::RmsNormGated, p, &bufs);
}

pub fn add_rms_norm<X: Executor>(
    c: &Cuda<X>,
    p: &RmsNormParams,
    x: &mut CudaBuf<X>,
    y: &CudaBuf<X>,
    w: &CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let (n, d) = ((p.rows * p.dim) as usize, p.dim as usize);
    let bufs = [("x", &*x, n), ("y", y, n), ("w", w, d), ("out", &*out, n)];
    row_norm(c, "add_rms_norm", F::AddRmsNorm, p, &bufs);
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
    let (n, d, rows) = ((p.rows * p.dim) as usize, p.dim as usize, p.rows as usize);
    let bufs = [
        ("x", &*x, n),
        ("y", y, n),
        ("shared", shared, n),
        ("gate", gate, rows),
        ("w", w, d),
        ("out", &*out, n),
    ];
    row_norm(c, "add_gated_rms_norm", F::AddGatedRmsNorm, p, &bufs);
}
