// qk_norm_rope: per-head RMSNorm (weight already 1 + w) then partial rotate-half RoPE on dims
// 0..rotary_dim at position pos0 + t, in place, for q inside qg [T, H, 2*hd] (q = first hd values
// of each head) and k [T, Hkv, hd]. inv_freq_j = theta^(-2j/rotary_dim); angles in f32.
// Bindings: 0 RopeParams, 1 q_norm [hd], 2 k_norm [hd], 3 qg (in/out), 4 k (in/out).
// Grid: threadgroups (H + Hkv, T): heads 0..H-1 are q heads, then the k heads; 256 threads
// striding over hd (<= 1024), normed values staged in threadgroup memory for the rotation.
#include "common.h"

kernel void qk_norm_rope_f32(constant RopeParams& p [[buffer(0)]], device const float* q_norm [[buffer(1)]],
                             device const float* k_norm [[buffer(2)]], device float* qg [[buffer(3)]],
                             device float* k [[buffer(4)]], uint2 tg [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]], uint ntg [[threads_per_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                             uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  threadgroup float v[1024];
  const uint hh = tg.x, t = tg.y, hd = p.head_dim;
  const bool is_q = hh < p.heads;
  device float* x = is_q ? qg + ((ulong)t * p.heads + hh) * 2 * hd : k + ((ulong)t * p.kv_heads + (hh - p.heads)) * hd;
  device const float* w = is_q ? q_norm : k_norm;
  float ss = 0.0f;
  for (uint i = tid; i < hd; i += ntg) ss += x[i] * x[i];
  const float inv = 1.0f / metal::precise::sqrt(tg_sum(ss, partial, sg, lane, nsg) / float(hd) + p.eps);
  for (uint i = tid; i < hd; i += ntg) v[i] = x[i] * inv * w[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint half_rot = p.rotary_dim / 2;
  const float pos = float(p.pos0 + t);
  for (uint i = tid; i < hd; i += ntg) {
    float r = v[i];
    if (i < p.rotary_dim) {
      const uint j = i % half_rot;
      const float inv_freq = metal::precise::pow(p.theta, -2.0f * float(j) / float(p.rotary_dim));
      const float angle = pos * inv_freq;
      const float c = metal::precise::cos(angle), s = metal::precise::sin(angle);
      r = i < half_rot ? v[i] * c - v[i + half_rot] * s : v[i] * c + v[i - half_rot] * s;
    }
    x[i] = r;
  }
}
