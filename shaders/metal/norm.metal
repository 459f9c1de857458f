// The norms (host: ops/norm/metal.rs).
// rms_norm / rms_norm_gated: out = x / sqrt(mean(x^2) + eps) * w (* silu(z) for the gated form)
// per row. x, z, out [rows, dim] f32, w [dim] f32.
// Bindings: 0 RmsNormParams, 1 x, 2 w, 3 out (gated: 1 x, 2 z, 3 w, 4 out).
// Grid: one threadgroup per row of dim rounded up to whole simdgroups, 32 to 256 threads
// (norm_threads), striding over dim; sum of squares reduced by simd_sum then across
// simdgroups through threadgroup memory. Accumulation: f32.
#include "common.h"

kernel void rms_norm_f32(constant RmsNormParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
                         device const float* w [[buffer(2)]], device float* out [[buffer(3)]],
                         uint row [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                         uint ntg [[threads_per_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  device const float* xr = x + (ulong)row * p.dim;
  float ss = 0.0f;
  for (uint i = tid; i < p.dim; i += ntg) ss += xr[i] * xr[i];
  const float inv = 1.0f / metal::precise::sqrt(tg_sum(ss, partial, sg, lane, nsg) / float(p.dim) + p.eps);
  for (uint i = tid; i < p.dim; i += ntg) out[(ulong)row * p.dim + i] = xr[i] * inv * w[i];
}

kernel void rms_norm_gated_f32(constant RmsNormParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
                               device const float* z [[buffer(2)]], device const float* w [[buffer(3)]],
                               device float* out [[buffer(4)]], uint row [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]], uint ntg [[threads_per_threadgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                               uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  device const float* xr = x + (ulong)row * p.dim;
  float ss = 0.0f;
  for (uint i = tid; i < p.dim; i += ntg) ss += xr[i] * xr[i];
  const float inv = 1.0f / metal::precise::sqrt(tg_sum(ss, partial, sg, lane, nsg) / float(p.dim) + p.eps);
  for (uint i = tid; i < p.dim; i += ntg) {
    const ulong o = (ulong)row * p.dim + i;
    out[o] = xr[i] * inv * w[i] * silu(z[o]);
  }
}

// add_rms_norm / add_gated_rms_norm: a residual add fused with the norm after it (one pass
// instead of an elementwise dispatch and a norm dispatch, and x read once instead of twice):
//   x += y (gated: x += y + sigmoid(gate[row]) * shared), then out = x / sqrt(mean(x^2) + eps) * w.
// x (in/out), y, shared, out [rows, dim] f32; gate [rows] f32 (one scalar per row: the shared
// expert's gate); w [dim]. Each thread writes the new x at its indices and reads them back after
// the reduction (its own writes: no barrier needed).
// Bindings: 0 RmsNormParams, 1 x, 2 y, 3 w, 4 out (gated: 1 x, 2 y, 3 shared, 4 gate, 5 w, 6 out).
// Grid: as rms_norm (one threadgroup per row, norm_threads threads striding over dim).
kernel void add_rms_norm_f32(constant RmsNormParams& p [[buffer(0)]], device float* x [[buffer(1)]],
                             device const float* y [[buffer(2)]], device const float* w [[buffer(3)]],
                             device float* out [[buffer(4)]], uint row [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]], uint ntg [[threads_per_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                             uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  device float* xr = x + (ulong)row * p.dim;
  device const float* yr = y + (ulong)row * p.dim;
  float ss = 0.0f;
  for (uint i = tid; i < p.dim; i += ntg) {
    const float v = xr[i] + yr[i];
    xr[i] = v;
    ss += v * v;
  }
  const float inv = 1.0f / metal::precise::sqrt(tg_sum(ss, partial, sg, lane, nsg) / float(p.dim) + p.eps);
  for (uint i = tid; i < p.dim; i += ntg) out[(ulong)row * p.dim + i] = xr[i] * inv * w[i];
}

kernel void add_gated_rms_norm_f32(constant RmsNormParams& p [[buffer(0)]], device float* x [[buffer(1)]],
                                   device const float* y [[buffer(2)]], device const float* shared [[buffer(3)]],
                                   device const float* gate [[buffer(4)]], device const float* w [[buffer(5)]],
                                   device float* out [[buffer(6)]], uint row [[threadgroup_position_in_grid]],
                                   uint tid [[thread_index_in_threadgroup]], uint ntg [[threads_per_threadgroup]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]],
                                   uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  device float* xr = x + (ulong)row * p.dim;
  device const float* yr = y + (ulong)row * p.dim;
  device const float* sr = shared + (ulong)row * p.dim;
  const float g = sigmoid(gate[row]);
  float ss = 0.0f;
  for (uint i = tid; i < p.dim; i += ntg) {
    const float v = xr[i] + g * sr[i] + yr[i];
    xr[i] = v;
    ss += v * v;
  }
  const float inv = 1.0f / metal::precise::sqrt(tg_sum(ss, partial, sg, lane, nsg) / float(p.dim) + p.eps);
  for (uint i = tid; i < p.dim; i += ntg) out[(ulong)row * p.dim + i] = xr[i] * inv * w[i];
}

// moe_experts_add_rms_norm: the MoE block's end after its per-pair expert GEMVs (`moe_gate_up`,
// `moe_down`: y [T*K, D], the expert output of each (token, slot) pair t*K + k), `moe_combine`
// and `add_gated_rms_norm` in one pass:
//   x += sigmoid(gate[row]) * shared + sum_k weights[row, k] * y[row*K + k], then
//   out = x / sqrt(mean(x^2) + eps) * w.
// The routed sum runs k ascending from 0 and is added as one term after the gated shared expert,
// the order of moe_combine followed by add_gated_rms_norm, so the result is theirs; the [T, D]
// routed sum is never written and read back, and one dispatch per layer goes.
// x (in/out), shared, out [rows, dim] f32; y [rows*K, dim]; weights [rows, K]; gate [rows]; w [dim].
// Bindings: 0 RmsNormParams (rows T, dim D), 1 MoeParams (top_k K), 2 weights, 3 y, 4 x,
// 5 shared, 6 gate, 7 w, 8 out.
// Grid: as rms_norm (one threadgroup per row, norm_threads threads striding over dim; each thread
// writes the new x at its indices and reads them back after the reduction).
kernel void moe_experts_add_rms_norm_f32(
    constant RmsNormParams& p [[buffer(0)]], constant MoeParams& mp [[buffer(1)]],
    device const float* weights [[buffer(2)]], device const float* y [[buffer(3)]], device float* x [[buffer(4)]],
    device const float* shared [[buffer(5)]], device const float* gate [[buffer(6)]],
    device const float* w [[buffer(7)]], device float* out [[buffer(8)]], uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]], uint ntg [[threads_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  const uint K = mp.top_k;
  device float* xr = x + (ulong)row * p.dim;
  device const float* sr = shared + (ulong)row * p.dim;
  device const float* wr = weights + (ulong)row * K;
  device const float* yr = y + (ulong)row * K * p.dim;
  const float g = sigmoid(gate[row]);
  float ss = 0.0f;
  for (uint i = tid; i < p.dim; i += ntg) {
    float routed = 0.0f;
    for (uint k = 0; k < K; ++k) routed += wr[k] * yr[(ulong)k * p.dim + i];
    const float v = xr[i] + g * sr[i] + routed;
    xr[i] = v;
    ss += v * v;
  }
  const float inv = 1.0f / metal::precise::sqrt(tg_sum(ss, partial, sg, lane, nsg) / float(p.dim) + p.eps);
  for (uint i = tid; i < p.dim; i += ntg) out[(ulong)row * p.dim + i] = xr[i] * inv * w[i];
}
