//! Gated DeltaNet (GDN, "linear attention"), architecture.md section 6: the two ops of a DeltaNet
//! layer between its input projections and its gated output norm.
//! - `delta_net_conv` (`ConvParams`): out [T, C] = silu(causal depthwise conv over the rows of
//!   [state; x]), x [T, C], w [C, taps], state [taps - 1, C] (oldest first) becoming the last
//!   taps - 1 rows; taps <= `MAX_CONV_TAPS` (the config is checked when read).
//! - `delta_net` (`DeltaNetParams`): the delta-rule recurrence over T tokens, per value head j
//!   (q/k head j / (Hv/Hk)): q, k l2-normed (q / sqrt(Dk)), beta = sigmoid(b),
//!   g = -exp(A_log) softplus(a + dt_bias); S <- e^g S, S <- S + k (beta (v - S^T k))^T,
//!   o = S^T q. qkv [T, 2 Hk Dk + Hv Dv] (q | k | v), a, b [T, Hv], a_log, dt_bias [Hv],
//!   state [Hv, Dk, Dv] f32 (in / out), out [T, Hv, Dv]. Decode runs the step form; prefill may
//!   run the chunked form (section 6.1), the same result up to f32 rounding.

pub mod cpu;
pub mod cuda;
pub mod metal;
pub mod reference;

use crate::{
    backend::{
        params::{ConvParams, DeltaNetParams, DELTA_NET_KEY_DIM_MAX, MAX_CONV_TAPS},
        Backend, DeltaNetGated,
    },
    ops::{sigmoid, softplus},
};

/// What a GPU encoder checks before a `delta_net_conv` dispatch, in one place for every backend:
/// the taps it supports, then (name, have, need) per buffer (in elements, argument order) for
/// the backend's `fits`. `have`: the lengths of w, state, x, out.
pub fn conv_checks(p: &ConvParams, have: [usize; 4]) -> Result<[(&'static str, usize, usize); 4], String> {
    let (t, c, taps) = (p.tokens as usize, p.channels as usize, p.taps as usize);
    if !(1..=MAX_CONV_TAPS).contains(&taps) {
        return Err(format!("delta_net_conv: {taps} taps unsupported (1..={MAX_CONV_TAPS})"));
    }
    let need = [c * taps, (taps - 1) * c, t * c, t * c];
    let names = ["w", "state", "x", "out"];
    Ok(std::array::from_fn(|i| (names[i], have[i], need[i])))
}

impl DeltaNetParams {
    /// (T tokens, Hk key heads, Hv value heads, Dk, Dv) as sizes.
    pub fn dims(&self) -> (usize, usize, usize, usize, usize) {
        (
            self.tokens as usize,
            self.key_heads as usize,
            self.value_heads as usize,
            self.key_dim as usize,
            self.value_dim as usize,
        )
    }
}

/// As [`conv_checks`] for `delta_net`: the head shapes every kernel supports (value heads a
/// multiple of the key heads, Dk <= `DELTA_NET_KEY_DIM_MAX`), then the buffers. `have`: the
/// lengths of qkv, a, b, a_log, dt_bias, state, out.
pub fn delta_net_checks(p: &DeltaNetParams, have: [usize; 7]) -> Result<[(&'static str, usize, usize); 7], String> {
    let (t, hk, hv, dk, dv) = p.dims();
    if hk == 0 || hv % hk != 0 || dk == 0 || dk > DELTA_NET_KEY_DIM_MAX || dv == 0 {
        return Err(format!(
            "delta_net: {hv} value heads on {hk} key heads of dim {dk}, value dim {dv} unsupported \
             (value heads a multiple of key heads, 1 <= Dk <= {DELTA_NET_KEY_DIM_MAX}, Dv >= 1)"
        ));
    }
    let need = [
        t * (2 * hk * dk + hv * dv),
        t * hv,
        t * hv,
        hv,
        hv,
        hv * dk * dv,
        t * hv * dv,
    ];
    let names = ["qkv", "a", "b", "a_log", "dt_bias", "state", "out"];
    Ok(std::array::from_fn(|i| (names[i], have[i], need[i])))
}

/// Whether the params of `delta_net_gated`'s three parts describe one layer's step, as a fused
/// kernel reads them: the conv over the T tokens' q | k | v rows (2 Hk Dk + Hv Dv channels), the
/// norm over each of the T Hv value heads' Dv outputs.
pub fn gated_parts_agree<B: Backend>(r: &DeltaNetGated<'_, B>) -> bool {
    let (o, (t, hk, hv, dk, dv)) = (&r.ops, r.ops.delta.dims());
    o.conv.tokens == o.delta.tokens
        && o.conv.channels as usize == 2 * hk * dk + hv * dv
        && r.norm.rows as usize == t * hv
        && r.norm.dim as usize == dv
}

/// As [`conv_checks`] for a fused `delta_net_gated` dispatch: the parts' own checks (taps, head
/// shapes), then (name, have, need) per buffer the kernel reads or writes, in its argument order.
/// `len`: a buffer's length in the backend (r's buffers); `have`: the lengths of conv_state,
/// state, out.
pub fn gated_checks<B: Backend>(
    r: &DeltaNetGated<'_, B>,
    len: impl Fn(&B::Buf) -> usize,
    have: [usize; 3],
) -> Result<[(&'static str, usize, usize); 11], String> {
    let o = &r.ops;
    let ([conv_state, state, out], [conv1d, proj, a, b]) = (have, [o.conv1d, o.proj, o.a, o.b].map(&len));
    let [a_log, dt_bias, norm_w, z] = [o.a_log, o.dt_bias, r.norm_w, r.z].map(&len);
    let conv = conv_checks(&o.conv, [conv1d, conv_state, proj, usize::MAX])?;
    let delta = delta_net_checks(&o.delta, [proj, a, b, a_log, dt_bias, state, out])?;
    let (t, hk, hv, dk, dv) = o.delta.dims();
    let n = t * hv * dv;
    Ok([
        conv[0],
        ("conv_state", conv[1].1, conv[1].2),
        ("proj", proj, t * (2 * hk * dk + hv * dv)),
        delta[1],
        delta[2],
        delta[3],
        delta[4],
        ("norm_w", norm_w, dv),
        ("z", z, n),
        delta[5],
        ("out", out, n),
    ])
}

/// The operands of `delta_net` that it only reads, in buffers of a backend (`Backend::delta_net`
/// takes `DeltaNetIn<B::Buf>`) or as host slices (the default, `DeltaNetIn<[f32]>`: what the
/// reference twins and the CPU kernel take). Both of those read a token's q / k / v rows and gates
/// through [`DeltaNetIn::heads`] and [`DeltaNetIn::gates`]; they differ in how they norm and recur.
pub struct DeltaNetIn<'a, Buf: ?Sized = [f32]> {
    pub p: &'a DeltaNetParams,
    /// [T, 2 Hk Dk + Hv Dv] (q | k | v), [T, Hv], [T, Hv], [Hv], [Hv].
    pub qkv: &'a Buf,
    pub a: &'a Buf,
    pub b: &'a Buf,
    pub a_log: &'a Buf,
    pub dt_bias: &'a Buf,
}

impl<'a, Buf: ?Sized> DeltaNetIn<'a, Buf> {
    /// The operands in the order the math names them.
    pub fn new(p: &'a DeltaNetParams, qkv: &'a Buf, a: &'a Buf, b: &'a Buf, a_log: &'a Buf, dt_bias: &'a Buf) -> Self {
        DeltaNetIn {
            p,
            qkv,
            a,
            b,
            a_log,
            dt_bias,
        }
    }

    /// The five buffers: qkv, a, b, a_log, dt_bias.
    pub fn bufs(&self) -> [&'a Buf; 5] {
        [self.qkv, self.a, self.b, self.a_log, self.dt_bias]
    }

    /// The same operands as host slices (the CPU backend's `Vec<f32>` buffers).
    pub fn slices(&self) -> DeltaNetIn<'a>
    where
        Buf: AsRef<[f32]>,
    {
        let [qkv, a, b, a_log, dt_bias] = self.bufs().map(AsRef::as_ref);
        DeltaNetIn::new(self.p, qkv, a, b, a_log, dt_bias)
    }
}

impl<'a> DeltaNetIn<'a> {
    /// Token t's q, k (before their norms) and v for value head j: q/k head j / (Hv/Hk).
    #[inline]
    pub fn heads(&self, t: usize, j: usize) -> (&'a [f32], &'a [f32], &'a [f32]) {
        let (_, hk, hv, dk, dv) = self.p.dims();
        let width = 2 * hk * dk + hv * dv;
        let row = &self.qkv[t * width..][..width];
        let kh = j / (hv / hk).max(1);
        (
            &row[kh * dk..][..dk],
            &row[hk * dk + kh * dk..][..dk],
            &row[2 * hk * dk + j * dv..][..dv],
        )
    }

    /// (beta, g) of value head j at token t: beta = sigmoid(b), g = -exp(A_log) softplus(a +
    /// dt_bias), the log of the step's decay.
    #[inline]
    pub fn gates(&self, t: usize, j: usize) -> (f32, f32) {
        let hv = self.p.value_heads as usize;
        let beta = sigmoid(self.b[t * hv + j]);
        let g = -self.a_log[j].exp() * softplus(self.a[t * hv + j] + self.dt_bias[j]);
        (beta, g)
    }
}
