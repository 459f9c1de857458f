// qk_norm_rope: per-head RMSNorm (weight already 1 + w) then partial rotate-half RoPE on dims
// 0..rotary_dim at position pos0 + t, in place, for q inside qg [T, H, 2*hd] (q = the first hd
// values of each head) and k [T, Hkv, hd]. inv_freq_j = theta^(-2j/rotary_dim); angles in f32.
// pos0 is read from step[0] (device memory, so a captured decode graph replays at any position);
// RopeParams.pos0 is not used. Arguments: RopeParams p, step [1] u32, q_norm [hd], k_norm [hd],
// qg (in/out), k (in/out). Grid (H + Hkv, T): heads 0..H-1 are q heads, then the k heads;
// 128 threads striding over hd (<= 1024), normed values staged in shared memory.
#include "common.cuh"

// The per-head RMSNorm (weight already 1 + w) of x[0..hd) staged in v, ending with a barrier (any
// thread may then read any v[i]); shared by qk_norm_rope and qk_norm_rope_store.
__device__ __forceinline__ void stage_normed(const RopeParams p, const float* x, const float* __restrict__ w,
                                             float* v) {
  __shared__ float partial[32];
  const uint hd = p.head_dim;
  float ss = 0.0f;
  for (uint i = threadIdx.x; i < hd; i += blockDim.x) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(block_sum(ss, partial) / (float)hd + p.eps);
  for (uint i = threadIdx.x; i < hd; i += blockDim.x) v[i] = x[i] * inv * w[i];
  __syncthreads();
}

// Value i of the staged head v after partial rotate-half RoPE at position pos.
__device__ __forceinline__ float rope_at(const RopeParams p, const float* v, uint i, float pos) {
  if (i >= p.rotary_dim) return v[i];
  const uint half_rot = p.rotary_dim / 2;
  const uint j = i % half_rot;
  const float inv_freq = powf(p.theta, -2.0f * (float)j / (float)p.rotary_dim);
  float s, c;
  sincosf(pos * inv_freq, &s, &c);
  return i < half_rot ? v[i] * c - v[i + half_rot] * s : v[i] * c + v[i - half_rot] * s;
}

extern "C" __global__ void __launch_bounds__(128) qk_norm_rope(const RopeParams p, const uint* __restrict__ step,
                                                               const float* __restrict__ q_norm,
                                                               const float* __restrict__ k_norm, float* qg,
                                                               float* k) {
  kernel_start();
  __shared__ float v[1024];
  const uint hh = blockIdx.x, t = blockIdx.y, hd = p.head_dim;
  const bool is_q = hh < p.heads;
  float* x = is_q ? qg + ((size_t)t * p.heads + hh) * 2 * hd : k + ((size_t)t * p.kv_heads + (hh - p.heads)) * hd;
  stage_normed(p, x, is_q ? q_norm : k_norm, v);
  const float pos = (float)(step[0] + t);
  for (uint i = threadIdx.x; i < hd; i += blockDim.x) x[i] = rope_at(p, v, i, pos);
}

// qk_norm_rope_store: qk_norm_rope fused with both kv_store's of an attention layer (one launch
// instead of three): q is normed and roped in place in qg [T, H, 2*hd]; k [T, Hkv, hd] is normed
// and roped straight into row step[0] + t of the K cache (k itself is left as it was); v [T, Hkv, hd]
// is copied into the V cache; both rounded to the cache dtype through their segment tables (KvDesc).
// Arguments: RopeParams p (pos0 unused), step, KvDesc k_cache, KvDesc v_cache, q_norm, k_norm,
// qg (in/out), k, v. Grid (H + 2 Hkv, T): q heads, then k heads, then v heads; threads as qk_norm_rope.
extern "C" __global__ void __launch_bounds__(128) qk_norm_rope_store(
    const RopeParams p, const uint* __restrict__ step, const KvDesc kd, const KvDesc vd,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm, float* qg, const float* __restrict__ k,
    const float* __restrict__ v) {
  kernel_start();
  __shared__ float staged[1024];
  const uint hh = blockIdx.x, t = blockIdx.y, hd = p.head_dim, kvw = p.kv_heads * hd;
  const uint row = step[0] + t;
  const float pos = (float)row;
  if (hh < p.heads) {
    float* x = qg + ((size_t)t * p.heads + hh) * 2 * hd;
    stage_normed(p, x, q_norm, staged);
    for (uint i = threadIdx.x; i < hd; i += blockDim.x) x[i] = rope_at(p, staged, i, pos);
  } else if (hh < p.heads + p.kv_heads) {
    const uint kh = hh - p.heads;
    stage_normed(p, k + (size_t)t * kvw + kh * hd, k_norm, staged);
    for (uint i = threadIdx.x; i < hd; i += blockDim.x) kv_put(kd, row, kh * hd + i, rope_at(p, staged, i, pos));
  } else {
    const uint vh = hh - p.heads - p.kv_heads;
    for (uint i = threadIdx.x; i < hd; i += blockDim.x) kv_put(vd, row, vh * hd + i, v[(size_t)t * kvw + vh * hd + i]);
  }
}
