// Gated DeltaNet (GDN): the causal depthwise conv and the delta-rule recurrence.
#include "common.cuh"

// delta_net_conv: out [T, C] = silu(sum_j w[c, j] * row(t + j)) over the rows of [state; x],
// state [taps - 1, C] (oldest first) becomes the last taps - 1 rows; w [C, taps], x [T, C] f32.
// Arguments: ConvParams p, w, state (in/out), x, out. Grid (ceil(C / 256)), 256 threads: one
// thread per channel walks the T tokens keeping the history in registers (taps <= MAX_CONV_TAPS,
// checked by the host). Reads of x and writes of out are coalesced across the channels.
#define CONV_TAPS_MAX 16
extern "C" __global__ void delta_net_conv(const ConvParams p, const float* __restrict__ w, float* __restrict__ state,
                                          const float* __restrict__ x, float* __restrict__ out) {
  const uint c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.channels) return;
  const uint hist = p.taps - 1, C = p.channels;
  float h[CONV_TAPS_MAX], wc[CONV_TAPS_MAX];
  for (uint i = 0; i < CONV_TAPS_MAX; ++i) {
    h[i] = i < hist ? state[(size_t)i * C + c] : 0.0f;
    wc[i] = i < p.taps ? w[(size_t)c * p.taps + i] : 0.0f;
  }
  for (uint t = 0; t < p.tokens; ++t) {
    const float xt = x[(size_t)t * C + c];
    float acc = 0.0f;
    for (uint j = 0; j < hist; ++j) acc += wc[j] * h[j];
    acc += wc[hist] * xt;
    for (uint i = 0; i + 1 < hist; ++i) h[i] = h[i + 1];
    if (hist > 0) h[hist - 1] = xt;
    out[(size_t)t * C + c] = silu(acc);
  }
  for (uint i = 0; i < hist; ++i) state[(size_t)i * C + c] = h[i];
}

// delta_net: T tokens of the recurrence, per value head j (q/k head j / (Hv / Hk)):
//   q <- l2norm(q) / sqrt(Dk), k <- l2norm(k), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
//   S <- e^g S; S <- S + k (beta (v - S^T k))^T; o = S^T q
// qkv [T, 2 Hk Dk + Hv Dv] (q | k | v), a / b [T, Hv], a_log / dt_bias [Hv], state [Hv, Dk, Dv]
// f32 (in/out), out [T, Hv, Dv]. Arguments: DeltaNetParams p, qkv, a, b, a_log, dt_bias, state,
// out. Grid (ceil(Dv / 32), Hv), 128 threads = 4 warps: lane l owns value column c = 32 bx + l
// (state rows are read 32 columns at a time: coalesced), warp w the key rows d = w, w + 4, ...
// (Dk <= 4 * DN_ROWS); the block's 32 x Dk slice of S stays in registers for all T tokens, so the
// state is read and written once per call. Per token: q and k are l2-normalised into shared
// memory by the whole block; S^T k and S^T q are summed per warp over its rows, then across the 4
// warps through shared memory. Recurrence and reductions in f32. Decode and prefill alike.
#define DN_WARPS 4
#define DN_ROWS 64
#define DN_DK_MAX (DN_WARPS * DN_ROWS)
extern "C" __global__ void __launch_bounds__(128) delta_net(const DeltaNetParams p, const float* __restrict__ qkv,
                                                            const float* __restrict__ a, const float* __restrict__ b,
                                                            const float* __restrict__ a_log,
                                                            const float* __restrict__ dt_bias,
                                                            float* __restrict__ state, float* __restrict__ out) {
  __shared__ float qs[DN_DK_MAX];
  __shared__ float kn[DN_DK_MAX];
  __shared__ float red[DN_WARPS * 32];
  __shared__ float partial[32];
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim;
  const uint j = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint c = blockIdx.x * 32 + lane;
  const bool col = c < Dv;
  const uint kh = j / (Hv / Hk);
  const uint width = 2 * Hk * Dk + Hv * Dv;
  const uint nr = (Dk + DN_WARPS - 1) / DN_WARPS;  // rows per warp (<= DN_ROWS)
  float* S = state + (size_t)j * Dk * Dv;
  float s[DN_ROWS];
  for (uint i = 0; i < DN_ROWS; ++i) {
    const uint d = warp + DN_WARPS * i;
    s[i] = i < nr && d < Dk && col ? S[(size_t)d * Dv + c] : 0.0f;
  }
  const float q_scale = rsqrtf((float)Dk);
  const float decay_rate = -expf(a_log[j]);
  for (uint t = 0; t < p.tokens; ++t) {
    const float* row = qkv + (size_t)t * width;
    float qq = 0.0f, kk = 0.0f;
    for (uint d = threadIdx.x; d < Dk; d += blockDim.x) {
      const float qv = row[kh * Dk + d], kv = row[Hk * Dk + kh * Dk + d];
      qs[d] = qv;
      kn[d] = kv;
      qq += qv * qv;
      kk += kv * kv;
    }
    const float q_inv = rsqrtf(block_sum(qq, partial) + 1e-6f) * q_scale;
    const float k_inv = rsqrtf(block_sum(kk, partial) + 1e-6f);  // block_sum's barriers also publish qs / kn
    const float v = col ? row[2 * Hk * Dk + j * Dv + c] : 0.0f;
    const float beta = sigmoid(b[(size_t)t * Hv + j]);
    const float alpha = expf(decay_rate * softplus(a[(size_t)t * Hv + j] + dt_bias[j]));
    float pred = 0.0f;
    for (uint i = 0; i < DN_ROWS; ++i) {
      const uint d = warp + DN_WARPS * i;
      if (i < nr && d < Dk) {
        s[i] *= alpha;
        pred += s[i] * kn[d] * k_inv;
      }
    }
    red[warp * 32 + lane] = pred;
    __syncthreads();
    pred = 0.0f;
    for (uint w = 0; w < DN_WARPS; ++w) pred += red[w * 32 + lane];
    const float delta = beta * (v - pred);
    float o = 0.0f;
    for (uint i = 0; i < DN_ROWS; ++i) {
      const uint d = warp + DN_WARPS * i;
      if (i < nr && d < Dk) {
        s[i] += kn[d] * k_inv * delta;
        o += s[i] * qs[d] * q_inv;
      }
    }
    __syncthreads();  // every warp has read red (pred) before it is overwritten
    red[warp * 32 + lane] = o;
    __syncthreads();
    if (warp == 0 && col) {
      float total = 0.0f;
      for (uint w = 0; w < DN_WARPS; ++w) total += red[w * 32 + lane];
      out[((size_t)t * Hv + j) * Dv + c] = total;
    }
    __syncthreads();  // red, qs and kn are rewritten by the next token
  }
  for (uint i = 0; i < DN_ROWS; ++i) {
    const uint d = warp + DN_WARPS * i;
    if (i < nr && d < Dk && col) S[(size_t)d * Dv + c] = s[i];
  }
}
