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
  float s[DN_ROWS];  // indexed only by unrolled loops: registers
#pragma unroll
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
#pragma unroll
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
#pragma unroll
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
#pragma unroll
  for (uint i = 0; i < DN_ROWS; ++i) {
    const uint d = warp + DN_WARPS * i;
    if (i < nr && d < Dk && col) S[(size_t)d * Dv + c] = s[i];
  }
}

// ------------------------------------------------------------------ prefill: prep + scan
// For more than a few tokens the host runs the recurrence in two kernels: delta_net_prep computes
// every token's normalised q, k and its gates in parallel, then delta_net_scan carries the state
// through the tokens with one lane per value column and the lane's whole column of S in registers
// (Dk <= 128): no block barrier and no cross-lane reduction in the token loop.
// Scratch (f32): qn [T, Hk, Dk] (l2-normalised, / sqrt(Dk)) | kn [T, Hk, Dk] | beta [T, Hv] |
// alpha [T, Hv] (the decay e^g).

// delta_net_prep: grid (T), 256 threads = 8 warps; warp w normalises q / k heads w, w + 8, ...
// (lanes over Dk, warp_sum), threads stride over the Hv gates. Arguments: DeltaNetParams p, qkv,
// a, b, a_log, dt_bias, scratch. f32.
extern "C" __global__ void __launch_bounds__(256) delta_net_prep(const DeltaNetParams p, const float* __restrict__ qkv,
                                                                 const float* __restrict__ a,
                                                                 const float* __restrict__ b,
                                                                 const float* __restrict__ a_log,
                                                                 const float* __restrict__ dt_bias,
                                                                 float* __restrict__ scratch) {
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim, T = p.tokens;
  const uint t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* row = qkv + (size_t)t * (2 * Hk * Dk + Hv * Dv);
  float* qn = scratch + (size_t)t * Hk * Dk;
  float* kn = scratch + (size_t)T * Hk * Dk + (size_t)t * Hk * Dk;
  float* beta = scratch + 2 * (size_t)T * Hk * Dk + (size_t)t * Hv;
  float* alpha = beta + (size_t)T * Hv;
  const float q_scale = rsqrtf((float)Dk);
  for (uint h = warp; h < Hk; h += blockDim.x / 32) {
    float qq = 0.0f, kk = 0.0f;
    for (uint d = lane; d < Dk; d += 32) {
      const float qv = row[h * Dk + d], kv = row[Hk * Dk + h * Dk + d];
      qq += qv * qv;
      kk += kv * kv;
    }
    const float qi = rsqrtf(warp_sum(qq) + 1e-6f) * q_scale, ki = rsqrtf(warp_sum(kk) + 1e-6f);
    for (uint d = lane; d < Dk; d += 32) {
      qn[h * Dk + d] = row[h * Dk + d] * qi;
      kn[h * Dk + d] = row[Hk * Dk + h * Dk + d] * ki;
    }
  }
  for (uint j = threadIdx.x; j < Hv; j += blockDim.x) {
    beta[j] = sigmoid(b[(size_t)t * Hv + j]);
    alpha[j] = expf(-expf(a_log[j]) * softplus(a[(size_t)t * Hv + j] + dt_bias[j]));
  }
}

// delta_net_scan: grid (ceil(Dv / 32), Hv), one warp per block; lane l owns value column
// c = 32 bx + l of value head j and holds S[0..Dk, c] in registers for all T tokens (the state is
// read and written once). Per token the warp stages the token's normalised k and q (shared memory,
// read as broadcasts), then each lane runs decay, S^T k, the delta-rule write and S^T q over its
// column with 4 partial sums. Arguments: DeltaNetParams p, qkv (v), scratch (delta_net_prep's),
// state [Hv, Dk, Dv] (in/out), out [T, Hv, Dv]. f32.
#define DN_SCAN_DK 128
extern "C" __global__ void __launch_bounds__(32) delta_net_scan(const DeltaNetParams p, const float* __restrict__ qkv,
                                                               const float* __restrict__ scratch,
                                                               float* __restrict__ state, float* __restrict__ out) {
  __shared__ float ks[DN_SCAN_DK];
  __shared__ float qs[DN_SCAN_DK];
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim, T = p.tokens;
  const uint j = blockIdx.y, lane = threadIdx.x, c = blockIdx.x * 32 + lane, kh = j / (Hv / Hk);
  const bool col = c < Dv;
  const uint width = 2 * Hk * Dk + Hv * Dv;
  float* S = state + (size_t)j * Dk * Dv;
  float s[DN_SCAN_DK];  // indexed only by unrolled loops: registers
#pragma unroll
  for (uint d = 0; d < DN_SCAN_DK; ++d) s[d] = d < Dk && col ? S[(size_t)d * Dv + c] : 0.0f;
  const float* qn = scratch;
  const float* kn = scratch + (size_t)T * Hk * Dk;
  const float* beta = scratch + 2 * (size_t)T * Hk * Dk;
  const float* alpha = beta + (size_t)T * Hv;
  for (uint t = 0; t < T; ++t) {
    for (uint d = lane; d < DN_SCAN_DK; d += 32) {
      ks[d] = d < Dk ? kn[((size_t)t * Hk + kh) * Dk + d] : 0.0f;
      qs[d] = d < Dk ? qn[((size_t)t * Hk + kh) * Dk + d] : 0.0f;
    }
    __syncwarp();
    const float al = alpha[(size_t)t * Hv + j], be = beta[(size_t)t * Hv + j];
    const float v = col ? qkv[(size_t)t * width + 2 * Hk * Dk + j * Dv + c] : 0.0f;
    float pr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (uint d = 0; d < DN_SCAN_DK; ++d) {
      s[d] *= al;
      pr[d % 4] += s[d] * ks[d];
    }
    const float delta = be * (v - ((pr[0] + pr[1]) + (pr[2] + pr[3])));
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (uint d = 0; d < DN_SCAN_DK; ++d) {
      s[d] += ks[d] * delta;
      o[d % 4] += s[d] * qs[d];
    }
    if (col) out[((size_t)t * Hv + j) * Dv + c] = (o[0] + o[1]) + (o[2] + o[3]);
    __syncwarp();  // ks / qs are rewritten by the next token
  }
#pragma unroll
  for (uint d = 0; d < DN_SCAN_DK; ++d)
    if (d < Dk && col) S[(size_t)d * Dv + c] = s[d];
}
