//! The norms on Metal (`shaders/metal/norm.metal`): one threadgroup per row of
//! [`norm_threads`] threads.

use crate::{
    backend::{
        metal::{args::bytes_of, norm_threads, Arg, Executor, Fixed, Grid, Metal, MetalBuf},
        moe_experts_add_rms_norm_unfused,
        params::{MoeParams, RmsNormParams},
        GatedAdd, MoeAddNorm,
    },
    ops::moe::metal::{decodes_per_pair, expert_gemvs, experts_fit, SharedPair},
};

/// Encode a norm kernel over `p.rows` rows (one threadgroup per row) after checking each buffer's
/// length: `bufs` are (name, buffer, elements needed) in the kernel's argument order, after the
/// params (as CUDA's `row_norm`).
fn row_norm<X: Executor>(
    m: &Metal<X>,
    op: &str,
    kernel: Fixed,
    p: &RmsNormParams,
    bufs: &[(&str, &MetalBuf<X>, usize)],
) {
    if let Err(e) = crate::ops::check_bufs(op, bufs, MetalBuf::len) {
        return m.fail(e);
    }
    let params = bytes_of(p);
    // Slot 0 the params, then the buffers; the slots past them are not bound.
    let args: [Arg<'_, X::Buffer>; 7] = std::array::from_fn(|i| match i.checked_sub(1).and_then(|j| bufs.get(j)) {
        Some((_, b, _)) => b.arg(),
        None => Arg::Bytes(params),
    });
    m.encode(kernel, &args[..=bufs.len()], rows(p));
}

pub fn rms_norm<X: Executor>(m: &Metal<X>, p: &RmsNormParams, x: &MetalBuf<X>, w: &MetalBuf<X>, out: &mut MetalBuf<X>) {
    let (n, d) = ((p.rows * p.dim) as usize, p.dim as usize);
    let bufs = [("x", x, n), ("w", w, d), ("out", &*out, n)];
    row_norm(m, "rms_norm", Fixed::RmsNorm, p, &bufs);
}

pub fn rms_norm_gated<X: Executor>(
    m: &Metal<X>,
    p: &RmsNormParams,
    x: &MetalBuf<X>,
    z: &MetalBuf<X>,
    w: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let (n, d) = ((p.rows * p.dim) as usize, p.dim as usize);
    let bufs = [("x", x, n), ("z", z, n), ("w", w, d), ("out", &*out, n)];
    row_norm(m, "rms_norm_gated", Fixed::RmsNormGated, p, &bufs);
}

/// x += y, then out = rms_norm(x, w), in one pass (`add_rms_norm`).
pub fn add_rms_norm<X: Executor>(
    m: &Metal<X>,
    p: &RmsNormParams,
    x: &mut MetalBuf<X>,
    y: &MetalBuf<X>,
    w: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let (n, d) = ((p.rows * p.dim) as usize, p.dim as usize);
    let bufs = [("x", &*x, n), ("y", y, n), ("w", w, d), ("out", &*out, n)];
    row_norm(m, "add_rms_norm", Fixed::AddRmsNorm, p, &bufs);
}

/// x += y + sigmoid(gate[row]) * shared, then out = rms_norm(x, w), in one pass
/// (`add_gated_rms_norm`).
pub fn add_gated_rms_norm<X: Executor>(
    m: &Metal<X>,
    p: &RmsNormParams,
    x: &mut MetalBuf<X>,
    add: &GatedAdd<'_, Metal<X>>,
    w: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let bufs = super::add_gated_bufs(p, x, add, w, out);
    row_norm(m, "add_gated_rms_norm", Fixed::AddGatedRmsNorm, p, &bufs);
}

/// x += moe_experts(h) + sigmoid(gate[row]) * shared, then h = rms_norm(x, w): for a decode step
/// (the per-pair expert path) the expert GEMVs (`moe_gate_up`, `moe_down`, into tmp) and one
/// `moe_experts_add_rms_norm` dispatch that sums the K expert rows into the residual and norms it
/// (`moe_combine` + `add_gated_rms_norm` in one); otherwise (the expert-sorted prefill) the parts.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_add_rms_norm<X: Executor>(
    m: &Metal<X>,
    moe: &MoeParams,
    p: &RmsNormParams,
    r: &MoeAddNorm<'_, Metal<X>>,
    tmp: &mut MetalBuf<X>,
    mix: &mut MetalBuf<X>,
    x: &mut MetalBuf<X>,
    h: &mut MetalBuf<X>,
) {
    experts_add_rms_norm(m, moe, p, r, None, tmp, mix, x, h)
}

/// `moe_experts_add_rms_norm`, and with `shared` `ops::moe::metal::moe_add_rms_norm`'s decode path:
/// the shared expert as T more pairs of the expert GEMVs (the caller has checked that it may: the
/// per-pair path, the experts' format and shapes), whose y rows [T, D] the norm kernel then reads
/// in place of `r.shared`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts_add_rms_norm<X: Executor>(
    m: &Metal<X>,
    moe: &MoeParams,
    p: &RmsNormParams,
    r: &MoeAddNorm<'_, Metal<X>>,
    shared: Option<SharedPair<'_, X>>,
    tmp: &mut MetalBuf<X>,
    mix: &mut MetalBuf<X>,
    x: &mut MetalBuf<X>,
    h: &mut MetalBuf<X>,
) {
    if !decodes_per_pair(m, moe, r.experts.gate) && shared.is_none() {
        return moe_experts_add_rms_norm_unfused(m, moe, p, r, tmp, mix, x, h);
    }
    let (n, d) = ((p.rows * p.dim) as usize, r.experts.gate.desc.cols as usize);
    if p.rows != moe.tokens || p.dim as usize != d {
        return m.fail(format!(
            "moe_experts_add_rms_norm: a norm of {} rows of {} after experts of {} tokens of {d}",
            p.rows, p.dim, moe.tokens
        ));
    }
    let (t, k, i) = (
        moe.tokens as usize,
        moe.top_k as usize,
        r.experts.gate.desc.rows as usize,
    );
    let pairs = t * k + shared.map_or(0, |_| t);
    let checks = [
        ("x", x.len(), n),
        ("shared", r.shared.len(), n),
        ("shared_gate", r.shared_gate.len(), p.rows as usize),
        ("norm_w", r.norm_w.len(), d),
        ("tmp", tmp.len(), pairs * (i + d)),
    ];
    if !experts_fit(m, moe, &r.experts, h, tmp, h) || !m.fits("moe_experts_add_rms_norm", &checks) {
        return;
    }
    let (y0, yn) = expert_gemvs(m, moe, &r.experts, h, shared, tmp);
    // The shared expert's output: its T pairs' rows of y, after the T*K routed ones.
    let shared_out = match shared {
        Some(_) => tmp.part(y0 + t * k * d, t * d),
        None => r.shared.arg(),
    };
    let args = [
        Arg::Bytes(bytes_of(p)),
        Arg::Bytes(bytes_of(moe)),
        r.experts.weights.arg(),
        tmp.part(y0, yn),
        x.arg(),
        shared_out,
        r.shared_gate.arg(),
        r.norm_w.arg(),
        h.arg(),
    ];
    m.encode(Fixed::MoeExpertsAddRmsNorm, &args, rows(p));
}

/// One threadgroup per row.
fn rows(p: &RmsNormParams) -> Grid {
    Grid::Groups {
        count: [p.rows, 1, 1],
        size: [norm_threads(p.dim as usize), 1, 1],
    }
}
