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
