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
