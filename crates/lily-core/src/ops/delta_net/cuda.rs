//! The Gated DeltaNet on CUDA (`shaders/cuda/delta_net.cu`): the causal conv, and the recurrence
//! (one-kernel step for decode; per-token prep + scan for prefill); for a decode step, the conv,
//! the recurrence and the gated output norm as one kernel (`delta_net_gated`).

use crate::backend::{
    cuda::{div, kernels::Fixed as F, shape, Args, Cuda, CudaBuf, Executor},
    delta_net_gated_unfused,
    params::{ConvParams, DELTA_NET_GATED_DIM_MAX, DELTA_NET_GATED_TAPS_MAX, MAX_CONV_TAPS},
    DeltaNetGated, DeltaNetIn,
};
use crate::ops::elementwise::cuda::copy_rows;

/// Tokens per conv tile (the kernel derives its tile from the grid); at least the longest
/// history, so a call of several tiles has its new state entirely in x.
const CONV_TILE: usize = 32;
const _: () = assert!(CONV_TILE >= MAX_CONV_TAPS - 1);

pub fn delta_net_conv<X: Executor>(
    c: &Cuda<X>,
    p: &ConvParams,
    w: &CudaBuf<X>,
    state: &mut CudaBuf<X>,
    x: &CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let checks = match super::conv_checks(p, [w.len, state.len, x.len, out.len]) {
        Ok(checks) => checks,
        Err(e) => return c.fail(e),
    };
    if !c.fits("delta_net_conv", &checks) {
        return;
    }
    let (t, ch, hist) = (p.tokens as usize, p.channels as usize, p.taps as usize - 1);
    // Tiles of CONV_TILE tokens over the grid's y: T-long dependent chains would leave most of
    // the GPU idle (C / 256 blocks). One tile (decode) updates the state in the kernel; with
    // several the kernel leaves it alone (its first tile reads it) and the last taps - 1 rows of
    // x (T > CONV_TILE >= taps - 1 there) are copied into it after.
    let tiles = div(t, CONV_TILE).clamp(1, 65535);
    let args = Args::new()
        .push(*p)
        .ptr(w.ptr())
        .ptr(state.ptr())
        .ptr(x.ptr())
        .ptr(out.ptr());
    c.launch(F::DeltaNetConv, shape([div(ch, 256), tiles, 1], 256), args);
    if tiles > 1 && hist > 0 {
        copy_rows(c, x, (t - hist) * ch, state, 0, hist * ch);
    }
}

pub fn delta_net<X: Executor>(
    c: &Cuda<X>,
    x: &DeltaNetIn<'_, CudaBuf<X>>,
    state: &mut CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let (p, [qkv, a, b, a_log, dt_bias]) = (x.p, x.bufs());
    let (t, hk, hv, dk, dv) = p.dims();
    let have = [qkv.len, a.len, b.len, a_log.len, dt_bias.len, state.len, out.len];
    let checks = match super::delta_net_checks(p, have) {
        Ok(checks) => checks,
        Err(e) => return c.fail(e),
    };
    if !c.fits("delta_net", &checks) {
        return;
    }
    // The recurrence's inputs, bound first by the prep and the one-kernel step.
    let inputs = || {
        Args::new()
            .push(*p)
            .ptr(qkv.ptr())
            .ptr(a.ptr())
            .ptr(b.ptr())
            .ptr(a_log.ptr())
            .ptr(dt_bias.ptr())
    };
    // Prefill (Dk <= 128): the per-token normalisation, k . q and gates in parallel, then the
    // scan with each value column of S in the registers of 4 lanes. Decode: the one-kernel step.
    if t > c.gemv_tokens && dk <= 128 {
        let need = t * (2 * hk * dk + 2 * hv + hk);
        let Some(sc) = c.scratch(need, "delta_net scratch", |s| &mut s.delta_scratch) else {
            return;
        };
        c.launch(F::DeltaNetPrep, shape([t as u32, 1, 1], 256), inputs().ptr(sc));
        let args = Args::new()
            .push(*p)
            .ptr(qkv.ptr())
            .ptr(sc)
            .ptr(state.ptr())
            .ptr(out.ptr());
        c.launch(F::DeltaNetScan, shape([div(dv, 32), hv as u32, 1], 128), args);
        return;
    }
    let args = inputs().ptr(state.ptr()).ptr(out.ptr());
    c.launch(F::DeltaNet, shape([div(dv, 32), hv as u32, 1], 128), args);
}

/// `delta_net_gated`: one `delta_net_gated` launch (a block per 32 value columns of a head) up to
/// `gemv_tokens` tokens with Dk, Dv <= 128 (the model's); otherwise, or with `LILY_CUDA_FUSED_DELTA_NET=0`, its parts (`delta_net_conv`,
/// `delta_net`, `rms_norm_gated`). The fused kernel leaves mixed alone and keeps its sums of
/// squares in core.
pub fn delta_net_gated<X: Executor>(
    c: &Cuda<X>,
    r: &DeltaNetGated<'_, Cuda<X>>,
    conv_state: &mut CudaBuf<X>,
    state: &mut CudaBuf<X>,
    mixed: &mut CudaBuf<X>,
    core: &mut CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let (o, p) = (&r.ops, &r.ops.delta);
    let (t, hk, hv, dk, dv) = p.dims();
    let fused = c.fused_delta_net
        && t <= c.gemv_tokens
        && dk <= DELTA_NET_GATED_DIM_MAX
        && dv <= DELTA_NET_GATED_DIM_MAX
        && o.conv.taps as usize <= DELTA_NET_GATED_TAPS_MAX
        && super::gated_parts_agree(r);
    if !fused {
        return delta_net_gated_unfused(c, r, conv_state, state, mixed, core, out);
    }
    // The parts' own checks (taps, head shapes), every buffer the kernel reads or writes, and the
    // sums of squares it keeps in core.
    let sums = ("core", core.len, t * hv * div(dv, 32) as usize);
    let checks = match super::gated_checks(r, |b| b.len, [conv_state.len, state.len, out.len]) {
        Ok(checks) => checks,
        Err(e) => return c.fail(e),
    };
    if !c.fits("delta_net_gated", &checks) || !c.fits("delta_net_gated", &[sums]) {
        return;
    }
    // One counter per key head; room for any model's (never regrown under a recorded launch).
    let Some(counts) = c.scratch(hk.max(64), "delta_net_gated counts", |s| &mut s.delta_counts) else {
        return;
    };
    let args = Args::new()
        .push(*p)
        .push(o.conv)
        .push(r.norm)
        .ptr(o.conv1d.ptr())
        .ptr(conv_state.ptr())
        .ptr(o.proj.ptr())
        .ptr(o.a.ptr())
        .ptr(o.b.ptr())
        .ptr(o.a_log.ptr())
        .ptr(o.dt_bias.ptr())
        .ptr(r.norm_w.ptr())
        .ptr(r.z.ptr())
        .ptr(state.ptr())
        .ptr(out.ptr())
        .ptr(core.ptr())
        .ptr(counts);
    // A block per 32 value columns of a head (4 a head at Dv = 128).
    c.launch(F::DeltaNetGated, shape([hv as u32, div(dv, 32), 1], 512), args);
}
