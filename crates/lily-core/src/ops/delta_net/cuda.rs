//! The Gated DeltaNet on CUDA (`shaders/cuda/delta_net.cu`): the causal conv, and the recurrence
//! (one-kernel step for decode; per-token prep + scan for prefill).

use crate::backend::{
    cuda::{div, kernels::Fixed as F, shape, Args, Cuda, CudaBuf, Executor},
    params::{ConvParams, DeltaNetParams, MAX_CONV_TAPS},
};

pub fn delta_net_conv<X: Executor>(
    c: &Cuda<X>,
    p: &ConvParams,
    w: &CudaBuf<X>,
    state: &mut CudaBuf<X>,
    x: &CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let (t, ch, taps) = (p.tokens as usize, p.channels as usize, p.taps as usize);
    if taps == 0 || taps > MAX_CONV_TAPS {
        c.fail(format!("delta_net_conv: {taps} taps (1..={MAX_CONV_TAPS})"));
        return;
    }
    if !c.fits(
        "delta_net_conv",
        &[
            ("w", w.len, ch * taps),
            ("state", state.len, (taps - 1) * ch),
            ("x", x.len, t * ch),
            ("out", out.len, t * ch),
        ],
    ) {
        return;
    }
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
    if hk == 0 || hv % hk != 0 || dk == 0 || dk > 256 || dv == 0 {
        c.fail(format!(
            "delta_net: {hv} value heads over {hk} key heads with key dim {dk} (at most 256) unsupported"
        ));
        return;
    }
    let width = 2 * hk * dk + hv * dv;
    if !c.fits(
        "delta_net",
        &[
            ("qkv", qkv.len, t * width),
            ("a", a.len, t * hv),
            ("b", b.len, t * hv),
            ("a_log", a_log.len, hv),
            ("dt_bias", dt_bias.len, hv),
            ("state", state.len, hv * dk * dv),
            ("out", out.len, t * hv * dv),
        ],
    ) {
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
