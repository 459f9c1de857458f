//! The norms on CUDA (`shaders/cuda/rms_norm.cu`): one block of 256 threads per row; the residual
//! add (and the MoE block's gated shared expert) fused with the norm after it (`add_rms_norm`,
//! `add_gated_rms_norm`: one launch instead of two or three).

use crate::{
    backend::{
        cuda::{kernels::Fixed as F, shape, Args, Cuda, CudaBuf, Executor},
        moe_experts_add_rms_norm_unfused,
        params::{MoeParams, RmsNormParams},
        GatedAdd, MoeAddNorm,
    },
    ops::moe::cuda::{decodes_per_pair, moe_experts_then, SharedPair},
};

/// Launch a norm kernel over `p.rows` rows (one block of 256 threads per row) after checking
/// each buffer's length: `bufs` are (name, buffer, elements needed) in the kernel's argument order.
fn row_norm<X: Executor>(c: &Cuda<X>, op: &str, kernel: F, p: &RmsNormParams, bufs: &[(&str, &CudaBuf<X>, usize)]) {
    if let Err(e) = crate::ops::check_bufs(op, bufs, |b| b.len) {
        return c.fail(e);
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

pub fn add_gated_rms_norm<X: Executor>(
    c: &Cuda<X>,
    p: &RmsNormParams,
    x: &mut CudaBuf<X>,
    add: &GatedAdd<'_, Cuda<X>>,
    w: &CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let bufs = super::add_gated_bufs(p, x, add, w, out);
    row_norm(c, "add_gated_rms_norm", F::AddGatedRmsNorm, p, &bufs);
}

/// x += moe_experts(h) + sigmoid(gate[row]) * shared, then h = rms_norm(x, w): for a decode step
/// the expert GEMVs (`moe_gate_up`, `moe_down`, into tmp) and one `moe_experts_add_rms_norm`
/// launch that sums the K expert rows into the residual and norms it (`moe_combine` +
/// `add_gated_rms_norm` in one); otherwise (the expert-sorted prefill) the parts.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_add_rms_norm<X: Executor>(
    c: &Cuda<X>,
    moe: &MoeParams,
    p: &RmsNormParams,
    r: &MoeAddNorm<'_, Cuda<X>>,
    tmp: &mut CudaBuf<X>,
    mix: &mut CudaBuf<X>,
    x: &mut CudaBuf<X>,
    h: &mut CudaBuf<X>,
) {
    experts_add_rms_norm(c, moe, p, r, None, tmp, mix, x, h)
}

/// `moe_experts_add_rms_norm`, and with `shared` `ops::moe::cuda::moe_add_rms_norm`'s decode path:
/// the shared expert as each token's last pair of the expert GEMVs (the caller has checked that it
/// may: a decode step, the experts' format), whose row of y the combine kernel then reads in place
/// of `r.shared`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts_add_rms_norm<X: Executor>(
    c: &Cuda<X>,
    moe: &MoeParams,
    p: &RmsNormParams,
    r: &MoeAddNorm<'_, Cuda<X>>,
    shared: Option<SharedPair<'_, X>>,
    tmp: &mut CudaBuf<X>,
    mix: &mut CudaBuf<X>,
    x: &mut CudaBuf<X>,
    h: &mut CudaBuf<X>,
) {
    if !decodes_per_pair(c, moe) && shared.is_none() {
        return moe_experts_add_rms_norm_unfused(c, moe, p, r, tmp, mix, x, h);
    }
    let (n, d) = ((p.rows * p.dim) as usize, p.dim as usize);
    if p.rows != moe.tokens || r.experts.gate.desc.cols != p.dim {
        return c.fail(format!(
            "moe_experts_add_rms_norm: a norm of {} rows of {d} after experts of {} tokens of {}",
            p.rows, moe.tokens, r.experts.gate.desc.cols
        ));
    }
    let checks = [
        ("x", x.len, n),
        ("shared", r.shared.len, n),
        ("shared_gate", r.shared_gate.len, p.rows as usize),
        ("norm_w", r.norm_w.len, d),
        ("h", h.len, n),
    ];
    if !c.fits("moe_experts_add_rms_norm", &checks) {
        return;
    }
    let (x_ptr, h_ptr) = (x.ptr(), h.ptr());
    // mix stands for moe_experts' output only in its checks: the sum goes into x.
    // y's rows per token, and where each token's shared expert row is (the kernel's comment).
    let (k, dim) = (moe.top_k as u64, p.dim as u64);
    let (y_stride, shared_stride) = match shared {
        Some(_) => ((k + 1) * dim, (k + 1) * dim),
        None => (k * dim, dim),
    };
    moe_experts_then(c, moe, &r.experts, h, shared, tmp, mix, |y| {
        let args = Args::new()
            .push(*p)
            .push(*moe)
            .push(y_stride)
            .ptr(r.experts.weights.ptr())
            .ptr(y)
            .ptr(x_ptr)
            .ptr(if shared.is_some() {
                y + k * dim * 4
            } else {
                r.shared.ptr()
            })
            .push(shared_stride)
            .ptr(r.shared_gate.ptr())
            .ptr(r.norm_w.ptr())
            .ptr(h_ptr);
        c.launch(F::MoeExpertsAddRmsNorm, shape([p.rows, 1, 1], 256), args);
    });
}
