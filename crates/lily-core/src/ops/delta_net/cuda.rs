//! The Gated DeltaNet on CUDA (`shaders/cuda/delta_net.cu`): the causal conv, and the recurrence
//! (one-kernel step for decode; per-token prep + scan for prefill).

use crate::backend::{
    cuda::{div, kernels::Fixed as F, shape, Args, Cuda, CudaBuf, Executor},
    params::{ConvParams, DeltaNetParams, MAX_CONV_TAPS},
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

#[allow(clippy::too_many_arguments)]
pub fn delta_net<X: Executor>(
    c: &Cuda<X>,
    p: &DeltaNetParams,
    qkv: &CudaBuf<X>,
    a: &CudaBuf<X>,
    b: &CudaBuf<X>,
    a_log: &CudaBuf<X>,
    dt_bias: &CudaBuf<X>,
    state: &mut CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let (t, hk, hv, dk, dv) = (
        p.tokens as usize,
        p.key_heads as usize,
        p.value_heads as usize,
        p.key_dim as usize,
        p.value_dim as usize,
    );
    let have = [qkv.len, a.len, b.len, a_log.len, dt_bias.len, state.len, out.len];
    let checks = match super::delta_net_checks(p, have) {
        Ok(checks) => checks,
        Err(e) => return c.fail(e),
    };
    if !c.fits("delta_net", &checks) {
        return;
    }
    // Prefill (Dk <= 128): the per-token normalisation, k . q and gates in parallel, then the
    // scan with each value column of S in the registers of 4 lanes. Decode: the one-kernel step.
    if t > c.gemv_tokens && dk <= 128 {
        let need = t * (2 * hk * dk + 2 * hv + hk);
        let Some(sc) = c.scratch(need, "delta_net scratch", |s| &mut s.delta_scratch) else {
            return;
        };
        let args = Args::new()
            .push(*p)
            .ptr(qkv.ptr())
            .ptr(a.ptr())
            .ptr(b.ptr())
            .ptr(a_log.ptr())
            .ptr(dt_bias.ptr())
            .ptr(sc);
        c.launch(F::DeltaNetPrep, shape([t as u32, 1, 1], 256), args);
        let args = Args::new()
            .push(*p)
            .ptr(qkv.ptr())
            .ptr(sc)
            .ptr(state.ptr())
            .ptr(out.ptr());
        c.launch(F::DeltaNetScan, shape([div(dv, 32), hv as u32, 1], 128), args);
        return;
    }
    let args = Args::new()
        .push(*p)
        .ptr(qkv.ptr())
        .ptr(a.ptr())
        .ptr(b.ptr())
        .ptr(a_log.ptr())
        .ptr(dt_bias.ptr())
        .ptr(state.ptr())
        .ptr(out.ptr());
    c.launch(F::DeltaNet, shape([div(dv, 32), hv as u32, 1], 128), args);
}
