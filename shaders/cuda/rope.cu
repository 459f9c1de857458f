// qk_norm_rope: per-head RMSNorm (weight already 1 + w) then partial rotate-half RoPE on dims
// 0..rotary_dim at position pos0 + t, in place, for q inside qg [T, H, 2*hd] (q = the first hd
// values of each head) and k [T, Hkv, hd]. inv_freq_j = theta^(-2j/rotary_dim); angles in f32.
// pos0 is read from step[0] (device memory, so a captured decode graph replays at any position);
// RopeParams.pos0 is not used. Arguments: RopeParams p, step [1] u32, q_norm [hd], k_norm [hd],
// qg (in/out), k (in/out). Grid (H + Hkv, T): heads 0..H-1 are q heads, then the k heads;
// 128 threads striding over hd (<= 1024), normed values staged in shared memory.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(128) qk_norm_rope(const RopeParams p, const uint* __restrict__ step,
                                                               const float* __restrict__ q_norm,
                                                               const float* __restrict__ k_norm, float* qg,
                                                               float* k) {
  __shared__ float partial[32];
  __shared__ float v[1024];
  const uint hh = blockIdx.x, t = blockIdx.y, hd = p.head_dim;
  const bool is_q = hh < p.heads;
  float* x = is_q ? qg + ((size_t)t * p.heads + hh) * 2 * hd : k + ((size_t)t * p.kv_heads + (hh - p.heads)) * hd;
  const float* w = is_q ? q_norm : k_norm;
  float ss = 0.0f;
  for (uint i = threadIdx.x; i < hd; i += blockDim.x) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(block_sum(ss, partial) / (float)hd + p.eps);
  for (uint i = threadIdx.x; i < hd; i += blockDim.x) v[i] = x[i] * inv * w[i];
  __syncthreads();
  const uint half_rot = p.rotary_dim / 2;
  const float pos = (float)(step[0] + t);
  for (uint i = threadIdx.x; i < hd; i += blockDim.x) {
    float r = v[i];
    if (i < p.rotary_dim) {
      const uint j = i % half_rot;
      const float inv_freq = powf(p.theta, -2.0f * (float)j / (float)p.rotary_dim);
      float s, c;
      sincosf(pos * inv_freq, &s, &c);
      r = i < half_rot ? v[i] * c - v[i + half_rot] * s : v[i] * c + v[i - half_rot] * s;
    }
    x[i] = r;
  }
}
