//! The Gated DeltaNet on CUDA (`shaders/cuda/delta_net.cu`): the causal conv, and the recurrence
//! (one-kernel step for decode; per-token prep + scan for prefill).

use crate::backend::{
    cuda::{div, kernels::Fixed as F, shape, Args, Cuda, CudaBuf, Executor},
    params::{ConvParams, DeltaNetParams},
};

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
    let ch = p.channels as usize;
    let args = Args::new()
        .push(*p)
        .ptr(w.ptr())
        .ptr(state.ptr())
        .ptr(x.ptr())
        .ptr(out.ptr());
    c.launch(F::DeltaNetConv, shape([div(ch, 256), 1, 1], 256), args);
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
    // Prefill (Dk <= 128): the per-token normalisation and gates in parallel, then the scan
    // with each value column of S in one lane's registers. Decode: the one-kernel step.
    if t > c.gemv_tokens && dk <= 128 {
        let need = t * (2 * hk * dk + 2 * hv);
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
        c.launch(F::DeltaNetScan, shape([div(dv, 32), hv as u32, 1], 32), args);
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
