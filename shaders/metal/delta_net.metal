// Gated DeltaNet (GDN): the causal depthwise conv and the delta-rule recurrence.
#include "common.h"

// delta_net_conv: out [T, C] = silu(sum_j w[c, j] * row(t + j)) over the rows of [state; x],
// state [taps - 1, C] (oldest first) becomes the last taps - 1 rows; w [C, taps], x [T, C] f32.
// Bindings: 0 ConvParams, 1 w, 2 state (in/out), 3 x, 4 out. Grid: dispatchThreads (C): one
// thread per channel walks the T tokens keeping the history in registers (taps <= 8).
kernel void delta_net_conv_f32(constant ConvParams& p [[buffer(0)]], device const float* w [[buffer(1)]],
                               device float* state [[buffer(2)]], device const float* x [[buffer(3)]],
                               device float* out [[buffer(4)]], uint c [[thread_position_in_grid]]) {
  if (c >= p.channels) return;
  const uint hist = p.taps - 1, C = p.channels;
  float h[8];
  for (uint i = 0; i < hist; ++i) h[i] = state[(ulong)i * C + c];
  for (uint t = 0; t < p.tokens; ++t) {
    const float xt = x[(ulong)t * C + c];
    float acc = 0.0f;
    for (uint j = 0; j < hist; ++j) acc += w[c * p.taps + j] * h[j];
    acc += w[c * p.taps + hist] * xt;
    for (uint i = 0; i + 1 < hist; ++i) h[i] = h[i + 1];
    if (hist > 0) h[hist - 1] = xt;
    out[(ulong)t * C + c] = silu(acc);
  }
  for (uint i = 0; i < hist; ++i) state[(ulong)i * C + c] = h[i];
}

// delta_net: T tokens of the recurrence, per value head j (q/k head j / (Hv/Hk)):
//   q <- l2norm(q) / sqrt(Dk), k <- l2norm(k), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
//   S <- e^g S; S <- S + k (beta (v - S^T k))^T; o = S^T q
// qkv [T, 2*Hk*Dk + Hv*Dv] (q | k | v), a/b [T, Hv], a_log/dt_bias [Hv], state [Hv, Dk, Dv] f32
// (in/out), out [T, Hv, Dv]. Bindings: 0 DeltaNetParams, 1 qkv, 2 a, 3 b, 4 a_log, 5 dt_bias,
// 6 state, 7 out. Grid: threadgroups (ceil(Dv / 4), Hv), 128 threads: simdgroup s owns value
// column c = 4 tg.x + s; lane holds S[d, c] for d = lane + 32 i (Dk <= 256) in registers for all
// T steps, so the state is read and written once per call. Recurrence and reductions in f32.
// Prefill runs the same step recurrence over T inside the kernel (as mlx-lm's kernel does).
kernel void delta_net_f32(constant DeltaNetParams& p [[buffer(0)]], device const float* qkv [[buffer(1)]],
                          device const float* a [[buffer(2)]], device const float* b [[buffer(3)]],
                          device const float* a_log [[buffer(4)]], device const float* dt_bias [[buffer(5)]],
                          device float* state [[buffer(6)]], device float* out [[buffer(7)]],
                          uint2 tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim;
  const uint c = tg.x * 4 + sg, j = tg.y;
  if (c >= Dv) return;  // whole simdgroup
  const uint kh = j / (Hv / Hk);
  const uint width = 2 * Hk * Dk + Hv * Dv;
  const uint nd = (Dk + 31) / 32;
  device float* S = state + (ulong)j * Dk * Dv;
  float s[8];
  for (uint i = 0; i < nd; ++i) {
    const uint d = lane + 32 * i;
    s[i] = d < Dk ? S[(ulong)d * Dv + c] : 0.0f;
  }
  const float q_scale = 1.0f / metal::precise::sqrt(float(Dk));
  const float decay_rate = -metal::precise::exp(a_log[j]);
  for (uint t = 0; t < p.tokens; ++t) {
    device const float* row = qkv + (ulong)t * width;
    float q[8], k[8];
    float qq = 0.0f, kk = 0.0f;
    for (uint i = 0; i < nd; ++i) {
      const uint d = lane + 32 * i;
      q[i] = d < Dk ? row[kh * Dk + d] : 0.0f;
      k[i] = d < Dk ? row[Hk * Dk + kh * Dk + d] : 0.0f;
      qq += q[i] * q[i];
      kk += k[i] * k[i];
    }
    const float q_inv = 1.0f / metal::precise::sqrt(simd_sum(qq) + 1e-6f);
    const float k_inv = 1.0f / metal::precise::sqrt(simd_sum(kk) + 1e-6f);
    const float v = row[2 * Hk * Dk + j * Dv + c];
    const float beta = sigmoid(b[t * Hv + j]);
    const float alpha = metal::precise::exp(decay_rate * softplus(a[t * Hv + j] + dt_bias[j]));
    float pred = 0.0f;
    for (uint i = 0; i < nd; ++i) {
      k[i] *= k_inv;
      q[i] = q[i] * q_inv * q_scale;
      s[i] *= alpha;
      pred += s[i] * k[i];
    }
    const float delta = beta * (v - simd_sum(pred));
    float o = 0.0f;
    for (uint i = 0; i < nd; ++i) {
      s[i] += k[i] * delta;
      o += s[i] * q[i];
    }
    o = simd_sum(o);
    if (lane == 0) out[((ulong)t * Hv + j) * Dv + c] = o;
  }
  for (uint i = 0; i < nd; ++i) {
    const uint d = lane + 32 * i;
    if (d < Dk) S[(ulong)d * Dv + c] = s[i];
  }
}
