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

pub fn rms_norm<X: Executor>(m: &Metal<X>, p: &RmsNormParams, x: &MetalBuf<X>, w: &MetalBuf<X>, out: &mut MetalBuf<X>) {
    let n = (p.rows * p.dim) as usize;
    let checks = [("x", x.len(), n), ("w", w.len(), p.dim as usize), ("out", out.len(), n)];
    if m.fits("rms_norm", &checks) {
        let args = [Arg::Bytes(bytes_of(p)), x.arg(), w.arg(), out.arg()];
        m.encode(Fixed::RmsNorm, &args, rows(p));
    }
}

pub fn rms_norm_gated<X: Executor>(
    m: &Metal<X>,
    p: &RmsNormParams,
    x: &MetalBuf<X>,
    z: &MetalBuf<X>,
    w: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let n = (p.rows * p.dim) as usize;
    let checks = [
        ("x", x.len(), n),
        ("z", z.len(), n),
        ("w", w.len(), p.dim as usize),
        ("out", out.len(), n),
    ];
    if m.fits("rms_norm_gated", &checks) {
        let args = [Arg::Bytes(bytes_of(p)), x.arg(), z.arg(), w.arg(), out.arg()];
        m.encode(Fixed::RmsNormGated, &args, rows(p));
    }
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
    let n = (p.rows * p.dim) as usize;
    let checks = [
        ("x", x.len(), n),
        ("y", y.len(), n),
        ("w", w.len(), p.dim as usize),
        ("out", out.len(), n),
    ];
    if m.fits("add_rms_norm", &checks) {
        let args = [Arg::Bytes(bytes_of(p)), x.arg(), y.arg(), w.arg(), out.arg()];
        m.encode(Fixed::AddRmsNorm, &args, rows(p));
    }
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
    let GatedAdd { y, shared, gate } = *add;
    let n = (p.rows * p.dim) as usize;
    let checks = [
        ("x", x.len(), n),
        ("y", y.len(), n),
        ("shared", shared.len(), n),
        ("gate", gate.len(), p.rows as usize),
        ("w", w.len(), p.dim as usize),
        ("out", out.len(), n),
    ];
    if m.fits("add_gated_rms_norm", &checks) {
        let args = [
            Arg::Bytes(bytes_of(p)),
            x.arg(),
            y.arg(),
            shared.arg(),
            gate.arg(),
            w.arg(),
            out.arg(),
        ];
        m.encode(Fixed::AddGatedRmsNorm, &args, rows(p));
    }
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
