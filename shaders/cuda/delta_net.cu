// Gated DeltaNet (GDN): the causal depthwise conv and the delta-rule recurrence.
#include "common.cuh"

// delta_net_conv: out [T, C] = silu(sum_j w[c, j] * row(t + j)) over the rows of [state; x],
// state [taps - 1, C] (oldest first) becomes the last taps - 1 rows; w [C, taps], x [T, C] f32.
// Arguments: ConvParams p, w, state (in/out), x, out. Grid (ceil(C / 256), tiles), 256 threads:
// thread (c, tile) computes the tokens t0 .. t0 + ceil(T / tiles) of channel c, keeping a window
// of the last MAX_CONV_TAPS rows in registers (right-aligned, zero-padded weights: every index is
// a constant of an unrolled loop); its history, the taps - 1 rows before t0, comes from x or, for
// the first tile, from the state. Reads of x and writes of out are coalesced across the channels.
// The state is in/out: with one tile (decode, short calls) each thread writes its channel's new
// state after reading the old; with several tiles no block writes it (the first tile reads it) and
// the host copies the last taps - 1 rows of x into it afterwards (T > taps - 1 there).
extern "C" __global__ void __launch_bounds__(256) delta_net_conv(const ConvParams p, const float* __restrict__ w,
                                                                 float* __restrict__ state,
                                                                 const float* __restrict__ x, float* __restrict__ out) {
  kernel_start();
  const uint c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.channels) return;
  const uint hist = p.taps - 1, C = p.channels, T = p.tokens;
  const uint tile = (T + gridDim.y - 1) / gridDim.y, t0 = blockIdx.y * tile;
  const uint t1 = min(T, t0 + tile);
  // Rows are numbered by token (the state's rows are -hist .. -1). At token t, win[MAX_CONV_TAPS
  // - 1 - k] holds row t - k and wr[MAX_CONV_TAPS - 1 - k] = w[c, taps - 1 - k] (0 for k >= taps).
  // Before the first token the window ends at row t0 - 1: the tile's history.
  float win[MAX_CONV_TAPS], wr[MAX_CONV_TAPS];
#pragma unroll
  for (uint i = 0; i < MAX_CONV_TAPS; ++i) {
    const uint k = MAX_CONV_TAPS - 1 - i;
    wr[i] = k < p.taps ? w[(size_t)c * p.taps + (p.taps - 1 - k)] : 0.0f;
    float h = 0.0f;  // row t0 - 1 - k: from x, or state row hist - (k + 1 - t0) before x
    if (k < hist) h = t0 > k ? x[(size_t)(t0 - 1 - k) * C + c] : state[(size_t)(hist + t0 - 1 - k) * C + c];
    win[i] = h;
  }
  for (uint t = t0; t < t1; ++t) {
#pragma unroll
    for (uint i = 0; i + 1 < MAX_CONV_TAPS; ++i) win[i] = win[i + 1];
    win[MAX_CONV_TAPS - 1] = x[(size_t)t * C + c];
    float acc = 0.0f;
#pragma unroll
    for (uint i = 0; i < MAX_CONV_TAPS; ++i) acc += wr[i] * win[i];
    out[(size_t)t * C + c] = silu(acc);
  }
  if (gridDim.y != 1) return;
  // One tile: the window now ends at row T - 1; new state row r = row T - hist + r (k = hist - 1 - r).
#pragma unroll
  for (uint k = 0; k + 1 < MAX_CONV_TAPS; ++k)
    if (k < hist) state[(size_t)(hist - 1 - k) * C + c] = win[MAX_CONV_TAPS - 1 - k];
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
  kernel_start();
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
// every token's normalised q, k, their dot product and its gates in parallel, then delta_net_scan
// carries the state through the tokens with each value column of S split over 4 lanes' registers
// (Dk <= 128).
// Scratch (f32): qn [T, Hk, Dk] (l2-normalised, / sqrt(Dk)) | kn [T, Hk, Dk] | beta [T, Hv] |
// alpha [T, Hv] (the decay e^g) | kq [T, Hk] (kn . qn).

// delta_net_prep: grid (T), 256 threads = 8 warps; warp w normalises q / k heads w, w + 8, ...
// (lanes over Dk, warp_sum), threads stride over the Hv gates. Arguments: DeltaNetParams p, qkv,
// a, b, a_log, dt_bias, scratch. f32.
extern "C" __global__ void __launch_bounds__(256) delta_net_prep(const DeltaNetParams p, const float* __restrict__ qkv,
                                                                 const float* __restrict__ a,
                                                                 const float* __restrict__ b,
                                                                 const float* __restrict__ a_log,
                                                                 const float* __restrict__ dt_bias,
                                                                 float* __restrict__ scratch) {
  kernel_start();
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim, T = p.tokens;
  const uint t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* row = qkv + (size_t)t * (2 * Hk * Dk + Hv * Dv);
  float* qn = scratch + (size_t)t * Hk * Dk;
  float* kn = scratch + (size_t)T * Hk * Dk + (size_t)t * Hk * Dk;
  float* beta = scratch + 2 * (size_t)T * Hk * Dk + (size_t)t * Hv;
  float* alpha = beta + (size_t)T * Hv;
  float* kq = scratch + 2 * (size_t)T * Hk * Dk + 2 * (size_t)T * Hv + (size_t)t * Hk;
  const float q_scale = rsqrtf((float)Dk);
  for (uint h = warp; h < Hk; h += blockDim.x / 32) {
    float qq = 0.0f, kk = 0.0f;
    for (uint d = lane; d < Dk; d += 32) {
      const float qv = row[h * Dk + d], kv = row[Hk * Dk + h * Dk + d];
      qq += qv * qv;
      kk += kv * kv;
    }
    const float qi = rsqrtf(warp_sum(qq) + 1e-6f) * q_scale, ki = rsqrtf(warp_sum(kk) + 1e-6f);
    float qk = 0.0f;
    for (uint d = lane; d < Dk; d += 32) {
      const float qv = row[h * Dk + d] * qi, kv = row[Hk * Dk + h * Dk + d] * ki;
      qn[h * Dk + d] = qv;
      kn[h * Dk + d] = kv;
      qk += qv * kv;
    }
    qk = warp_sum(qk);
    if (lane == 0) kq[h] = qk;
  }
  for (uint j = threadIdx.x; j < Hv; j += blockDim.x) {
    beta[j] = sigmoid(b[(size_t)t * Hv + j]);
    alpha[j] = expf(-expf(a_log[j]) * softplus(a[(size_t)t * Hv + j] + dt_bias[j]));
  }
}

// delta_net_scan: grid (ceil(Dv / 32), Hv), 128 threads = 4 warps; value column c = 32 bx +
// 8 w + l / 4 of value head j belongs to the 4 lanes l = 4 (c % 8) + r of warp w, lane r holding
// rows d = 32 r .. 32 r + 31 of S[:, c] in registers for all T tokens (the state is read and
// written once). Per token, with the old S (alpha the decay e^g, kq = k . q):
//   pk = S^T k, pq = S^T q (each lane over its 32 rows, then two __shfl_xor steps over the 4),
//   delta = beta (v - alpha pk), o = alpha pq + kq delta (= S_new^T q), S <- alpha S + k delta^T.
// The inputs of DN_SCAN_TOK tokens at a time (k, q, the block's 32 v columns, alpha, beta, kq)
// are staged in shared memory, double-buffered: the block loads the next group into registers
// while it computes the current one, and stores it behind one barrier per group, so the loads'
// latency hides behind DN_SCAN_TOK tokens of work. Row d of a staged k / q sits at DN_SCAN_LD
// (d / 32) + d % 32: a lane reads its 32 rows as float4, the 4 lanes of a column from distinct
// banks. Arguments: DeltaNetParams p, qkv (v), scratch (delta_net_prep's), state [Hv, Dk, Dv]
// (in/out), out [T, Hv, Dv]. f32.
#define DN_SCAN_DK 128                            // Dk of the scan at most (one staged row per thread)
#define DN_SCAN_SPLIT 4                           // lanes per value column
#define DN_SCAN_RPL (DN_SCAN_DK / DN_SCAN_SPLIT)  // rows of S per lane
#define DN_SCAN_LD (DN_SCAN_RPL + 4)              // staged floats per lane's rows (+4: no bank conflicts)
#define DN_SCAN_TOK 8                             // tokens staged per barrier
#define DN_SCAN_V (DN_SCAN_TOK * 32 / DN_SCAN_DK) // v values each thread stages per group
struct ScanStage {
  float k[DN_SCAN_TOK][DN_SCAN_SPLIT * DN_SCAN_LD];
  float q[DN_SCAN_TOK][DN_SCAN_SPLIT * DN_SCAN_LD];
  float v[DN_SCAN_TOK][32];
  float gate[DN_SCAN_TOK][4];  // alpha, beta, kq
};
extern "C" __global__ void __launch_bounds__(DN_SCAN_DK) delta_net_scan(const DeltaNetParams p,
                                                                       const float* __restrict__ qkv,
                                                                       const float* __restrict__ scratch,
                                                                       float* __restrict__ state,
                                                                       float* __restrict__ out) {
  kernel_start();
  __shared__ __align__(16) ScanStage st[2];
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim, T = p.tokens;
  const uint j = blockIdx.y, kh = j / (Hv / Hk), tid = threadIdx.x, lane = tid % 32, r = lane % DN_SCAN_SPLIT;
  const uint cl = (tid / 32) * (32 / DN_SCAN_SPLIT) + lane / DN_SCAN_SPLIT;  // column within the block
  const uint c = blockIdx.x * 32 + cl;
  const bool col = c < Dv;
  const uint width = 2 * Hk * Dk + Hv * Dv;
  const uint staged = (tid / DN_SCAN_RPL) * DN_SCAN_LD + tid % DN_SCAN_RPL;  // where this thread stages row tid
  float* S = state + (size_t)j * Dk * Dv;
  float s[DN_SCAN_RPL];  // rows 32 r + i; indexed only by unrolled loops: registers
#pragma unroll
  for (uint i = 0; i < DN_SCAN_RPL; ++i) {
    const uint d = r * DN_SCAN_RPL + i;
    s[i] = d < Dk && col ? S[(size_t)d * Dv + c] : 0.0f;
  }
  const float* qn = scratch;
  const float* kn = scratch + (size_t)T * Hk * Dk;
  const float* beta = scratch + 2 * (size_t)T * Hk * Dk;
  const float* alpha = beta + (size_t)T * Hv;
  const float* kqs = alpha + (size_t)T * Hv;
  // This thread's share of the group of tokens t0 ..: row tid of k and q, DN_SCAN_V of the v
  // values, one gate (threads below 3 DN_SCAN_TOK). Tokens past T stage zeros.
  float nk[DN_SCAN_TOK], nq[DN_SCAN_TOK], nv[DN_SCAN_V], ng = 0.0f;
  auto fetch = [&](uint t0) {
#pragma unroll
    for (uint u = 0; u < DN_SCAN_TOK; ++u) {
      const bool in = t0 + u < T && tid < Dk;
      nk[u] = in ? kn[((size_t)(t0 + u) * Hk + kh) * Dk + tid] : 0.0f;
      nq[u] = in ? qn[((size_t)(t0 + u) * Hk + kh) * Dk + tid] : 0.0f;
    }
#pragma unroll
    for (uint m = 0; m < DN_SCAN_V; ++m) {
      const uint e = tid + DN_SCAN_DK * m, u = e / 32, vc = blockIdx.x * 32 + e % 32;
      nv[m] = t0 + u < T && vc < Dv ? qkv[(size_t)(t0 + u) * width + 2 * Hk * Dk + j * Dv + vc] : 0.0f;
    }
    if (tid < 3 * DN_SCAN_TOK) {
      const uint u = tid / 3, g = tid % 3;
      const size_t t = t0 + u;
      ng = t0 + u >= T ? 0.0f : g == 0 ? alpha[t * Hv + j] : g == 1 ? beta[t * Hv + j] : kqs[t * Hk + kh];
    }
  };
  auto stage = [&](ScanStage& b) {
#pragma unroll
    for (uint u = 0; u < DN_SCAN_TOK; ++u) {
      b.k[u][staged] = nk[u];
      b.q[u][staged] = nq[u];
    }
#pragma unroll
    for (uint m = 0; m < DN_SCAN_V; ++m) {
      const uint e = tid + DN_SCAN_DK * m;
      b.v[e / 32][e % 32] = nv[m];
    }
    if (tid < 3 * DN_SCAN_TOK) b.gate[tid / 3][tid % 3] = ng;
  };
  if (T > 0) {
    fetch(0);
    stage(st[0]);
  }
  __syncthreads();
  for (uint t0 = 0, g = 0; t0 < T; t0 += DN_SCAN_TOK, g ^= 1) {
    if (t0 + DN_SCAN_TOK < T) fetch(t0 + DN_SCAN_TOK);  // in flight while this group is computed
    const ScanStage& b = st[g];
    const uint n = min((uint)DN_SCAN_TOK, T - t0);
    for (uint u = 0; u < n; ++u) {
      const float al = b.gate[u][0], be = b.gate[u][1], kq = b.gate[u][2], v = b.v[u][cl];
      const float4* k4 = (const float4*)(b.k[u] + r * DN_SCAN_LD);
      const float4* q4 = (const float4*)(b.q[u] + r * DN_SCAN_LD);
      float pk[2] = {0.0f, 0.0f}, pq[2] = {0.0f, 0.0f};
#pragma unroll
      for (uint i = 0; i < DN_SCAN_RPL / 4; ++i) {
        const float4 kv = k4[i], qv = q4[i];
        pk[i % 2] += s[4 * i] * kv.x + s[4 * i + 1] * kv.y + s[4 * i + 2] * kv.z + s[4 * i + 3] * kv.w;
        pq[i % 2] += s[4 * i] * qv.x + s[4 * i + 1] * qv.y + s[4 * i + 2] * qv.z + s[4 * i + 3] * qv.w;
      }
      float sk = pk[0] + pk[1], sq = pq[0] + pq[1];
#pragma unroll
      for (uint m = 1; m < DN_SCAN_SPLIT; m *= 2) {
        sk += __shfl_xor_sync(FULL_MASK, sk, m);
        sq += __shfl_xor_sync(FULL_MASK, sq, m);
      }
      const float delta = be * (v - al * sk);
      if (col && r == 0) out[((size_t)(t0 + u) * Hv + j) * Dv + c] = al * sq + kq * delta;
#pragma unroll
      for (uint i = 0; i < DN_SCAN_RPL / 4; ++i) {
        const float4 kv = k4[i];
        s[4 * i] = al * s[4 * i] + kv.x * delta;
        s[4 * i + 1] = al * s[4 * i + 1] + kv.y * delta;
        s[4 * i + 2] = al * s[4 * i + 2] + kv.z * delta;
        s[4 * i + 3] = al * s[4 * i + 3] + kv.w * delta;
      }
    }
    if (t0 + DN_SCAN_TOK < T) stage(st[g ^ 1]);
    __syncthreads();  // the next group staged; every thread is done reading this one
  }
#pragma unroll
  for (uint i = 0; i < DN_SCAN_RPL; ++i) {
    const uint d = r * DN_SCAN_RPL + i;
    if (d < Dk && col) S[(size_t)d * Dv + c] = s[i];
  }
}

// ------------------------------------------------------------------ decode: conv + recurrence + gated norm
// delta_net_gated: a decode step's DeltaNet core in one kernel, T tokens of one sequence (the host
// takes it up to the GEMV token limit): out = rms_norm_gated(delta_net(delta_net_conv(proj)), z),
// the kernels above and rms_norm.cu's rms_norm_gated composed, without their round trips.
// proj [T, C] (q | k | v before the conv, C = 2 Hk Dk + Hv Dv), conv_w [C, taps], conv_state
// [taps - 1, C] (oldest first, in/out), a / b [T, Hv], a_log / dt_bias [Hv], norm_w [Dv], z / out
// [T, Hv Dv], state [Hv, Dk, Dv] f32 (in/out), core [T, Hv, ceil(Dv / 32)] f32 (scratch: the
// caller's core buffer), counts [Hk] u32 (zero; left zero). Dk, Dv <= 128, taps <= 4.
// Arguments: DeltaNetParams p, ConvParams cp (channels C, taps), RmsNormParams np (eps), conv_w,
// conv_state, proj, a, b, a_log, dt_bias, norm_w, z, state, out, core, counts.
// Grid (Hv, ceil(Dv / 32)), 512 threads = 16 warps: block (j, g) is value head j (key head
// kh = j / (Hv / Hk)) and its value columns c = 32 g + lane (4 blocks a head at Dv = 128: 128
// blocks for the model's 32 heads, where one block per head left 100 of 132 SMs idle and streamed
// a head's 64 KB of state through one SM).
// - Conv: thread i < Dk owns q channel i and k channel i of key head kh (every block of kh
//   recomputes them: 2 Dk channels), thread 128 + l the v channel of the block's column 32 g + l;
//   each keeps its channels' last taps rows in a register window across the T tokens (as
//   delta_net_conv with one tile) and puts each token's silu(conv) in shared memory (qs, kn, vs,
//   double-buffered by token parity); warps 0-3 also sum q.q, k.k and q.k per warp.
// - Recurrence: warp w holds rows d = w + 16 i (i < 8) of the block's 32 columns of S_j in
//   registers for all T tokens. Per token one pass over the old S gives both partial sums S^T k
//   and S^T q (k, q as conv'd, their norms applied after), summed over the 16 warps through shared
//   memory; then, as delta_net_scan: delta = beta (v - alpha S^T k_n), o = alpha S^T q_n + (k_n .
//   q_n) delta (= S_new^T q_n), S <- alpha S + k_n delta^T. Two block barriers a token.
// - Norm (couples a head's Dv columns, spread over its blocks): warp 0 stores o * norm_w * silu(z)
//   into out and the sum of its 32 columns' o^2 into core; the last block of key head kh to finish
//   (last_block of common.cuh: one device-scope fence and one atomicAdd on counts[kh] a block; the
//   block that sees Hv / Hk * gridDim.y - 1 is the last, and sets the count back to 0 for the next
//   launch, graph replays included) reads the sums of its Hv / Hk value heads back and scales
//   their out by 1 / rms.
// Conv state ownership (each channel updated exactly once, never read after another block updated
// it): the v channels of block (j, g)'s columns are read and written by that block alone, after
// its reads. The q/k channels of key head kh are read by all its blocks at their start, before
// they count themselves on counts[kh]; the last one writes their new state. S: each block reads and
// writes its own columns. Every load of a thread (weights, conv state, its 8 rows of S, the first
// token's inputs) is issued before the first barrier. f32 throughout.
// Programmatic launch: the weights, the conv state and S are loaded before grid_dep_wait(), so
// their latency (S: 16 KB a block from DRAM) hides behind the input projection's tail. The states
// were last written by this kernel in an earlier forward call, and every call ends in a stream
// synchronization (the host's), so they are complete; they are read through L2 (load_l2: an
// earlier call's block on this SM may have left a stale L1 line). The inputs, which the
// projection just wrote, come after the wait through load_l2 too: as `const __restrict__` loads
// (ld.global.nc) ptxas scheduled z's above griddepcontrol.wait, which read it stale (the decode
// graph and programmatic-launch tests failed on an H100, 2026-12-07). Against every load after
// the wait (H200, 2026-12-07, three alternating rounds): 40 layers 511-529 against 492-506 decode
// tok/s at depth 512, 487-497 against 475-491 at 4,096.
#define DNG_DK DELTA_NET_GATED_DIM_MAX  // Dk and Dv at most
#define DNG_THREADS 512                 // 16 warps: a warp per row group of 32 columns
#define DNG_RW (DNG_THREADS / 32)       // row warps
#define DNG_NR (DNG_DK / DNG_RW)        // rows of S per thread
#define DNG_QK_WARPS (DNG_DK / 32)      // the warps of the q/k conv threads
#define DNG_W DELTA_NET_GATED_TAPS_MAX  // conv window (the host checks taps <= DNG_W)
// At most 64 registers (two blocks' worth fit an SM): under programmatic launch a block of the
// kernel before or after this one can be resident beside one of these.
extern "C" __global__ void __launch_bounds__(DNG_THREADS, 2) delta_net_gated(const DeltaNetParams p, const ConvParams cp,
                                                                            const RmsNormParams np,
                                                                            const float* __restrict__ conv_w,
                                                                            float* __restrict__ conv_state,
                                                                            const float* __restrict__ proj,
                                                                            const float* __restrict__ a,
                                                                            const float* __restrict__ b,
                                                                            const float* __restrict__ a_log,
                                                                            const float* __restrict__ dt_bias,
                                                                            const float* __restrict__ norm_w,
                                                                            const float* __restrict__ z,
                                                                            float* __restrict__ state,
                                                                            float* __restrict__ out,
                                                                            float* __restrict__ core,
                                                                            uint* __restrict__ counts) {
  __shared__ float qs[2][DNG_DK];
  __shared__ float kn[2][DNG_DK];
  __shared__ float vs[2][32];
  // red: per thread, its rows' share of S^T k and S^T q; part: per q/k warp, q.q, k.k and q.k.
  __shared__ float red[2][DNG_THREADS];
  __shared__ float part[3][DNG_QK_WARPS];
  __shared__ uint last[1];
  grid_dep_launch();  // grid_dep_wait(): once the weights, conv state and S are in flight
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim, T = p.tokens;
  if (T == 0) return;  // nothing to advance (the token loop below runs at least once)
  const uint C = cp.channels, taps = cp.taps, hist = taps - 1;
  const uint j = blockIdx.x, tid = threadIdx.x, rg = tid / 32, lane = tid % 32;
  const uint per = Hv / Hk, kh = j / per, c = 32 * blockIdx.y + lane;
  const bool col = c < Dv;
  // This thread's conv channels (C: none): q and k channel tid, or the v channel of column cv.
  const bool qk = tid < Dk;
  const uint vt = tid >= DNG_DK ? tid - DNG_DK : 32, cv = 32 * blockIdx.y + vt;
  const bool vch = vt < 32 && cv < Dv;
  const uint ch0 = qk ? kh * Dk + tid : vch ? 2 * Hk * Dk + j * Dv + cv : C;
  const uint ch1 = qk ? Hk * Dk + kh * Dk + tid : C;
  // Windows as delta_net_conv's: win[W - 1 - k] holds row t - k (rows -hist .. -1 are the state),
  // wr[W - 1 - k] = w[ch, taps - 1 - k] (0 for k >= taps).
  float win0[DNG_W], win1[DNG_W], wr0[DNG_W], wr1[DNG_W];
#pragma unroll
  for (uint i = 0; i < DNG_W; ++i) {
    const uint k = DNG_W - 1 - i;
    wr0[i] = ch0 < C && k < taps ? conv_w[(size_t)ch0 * taps + (taps - 1 - k)] : 0.0f;
    wr1[i] = ch1 < C && k < taps ? conv_w[(size_t)ch1 * taps + (taps - 1 - k)] : 0.0f;
  }
  const float al = a_log[j], dtb = dt_bias[j], wn = col ? norm_w[c] : 0.0f;
  // Every read of the old conv state happens here, before this block counts itself.
#pragma unroll
  for (uint i = 0; i < DNG_W; ++i) {
    const uint k = DNG_W - 1 - i;
    win0[i] = ch0 < C && k < hist ? load_l2(conv_state + (size_t)(hist - 1 - k) * C + ch0) : 0.0f;
    win1[i] = ch1 < C && k < hist ? load_l2(conv_state + (size_t)(hist - 1 - k) * C + ch1) : 0.0f;
  }
  float* S = state + (size_t)j * Dk * Dv;
  float s[DNG_NR];  // rows rg + 16 i; indexed only by unrolled loops: registers
#pragma unroll
  for (uint i = 0; i < DNG_NR; ++i) {
    const uint d = rg + DNG_RW * i;
    s[i] = col && d < Dk ? load_l2(S + d * Dv + c) : 0.0f;  // d Dv + c < 2^14
  }
  grid_dep_wait();  // the inputs below are the kernels before this one's
  // Token t's inputs (load_l2: never above the wait, see above). The first token's are loaded
  // here, in one group of loads with no branch or use between them (a load behind another's use
  // adds a memory latency to the chain); a later token's at the end of the token before.
  float x0, x1, at, bt, zt;
  auto inputs = [&](uint t) {
    x0 = ch0 < C ? load_l2(proj + (size_t)t * C + ch0) : 0.0f;
    x1 = ch1 < C ? load_l2(proj + (size_t)t * C + ch1) : 0.0f;
    at = load_l2(a + (size_t)t * Hv + j);
    bt = load_l2(b + (size_t)t * Hv + j);
    zt = rg == 0 && col ? load_l2(z + ((size_t)t * Hv + j) * Dv + c) : 0.0f;
  };
  inputs(0);
  const float q_scale = rsqrtf((float)Dk), decay_rate = -expf(al);
  for (uint t = 0;;) {
    const uint bf = t & 1u;
    const size_t o_at = ((size_t)t * Hv + j) * Dv + c;
    // The conv of this thread's channels (a thread without one: zero weights and window, y 0).
#pragma unroll
    for (uint i = 0; i + 1 < DNG_W; ++i) {
      win0[i] = win0[i + 1];
      win1[i] = win1[i + 1];
    }
    win0[DNG_W - 1] = x0;
    win1[DNG_W - 1] = x1;
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (uint i = 0; i < DNG_W; ++i) {
      acc0 += wr0[i] * win0[i];
      acc1 += wr1[i] * win1[i];
    }
    const float y0 = silu(acc0), y1 = silu(acc1);
    if (qk) {
      qs[bf][tid] = y0;
      kn[bf][tid] = y1;
    } else if (vch) {
      vs[bf][vt] = y0;
    }
    if (rg < DNG_QK_WARPS) {  // q/k threads only (v threads start at DNG_DK)
      const float qq = warp_sum(y0 * y0), kk = warp_sum(y1 * y1), qkd = warp_sum(y0 * y1);
      if (lane == 0) {
        part[0][rg] = qq;
        part[1][rg] = kk;
        part[2][rg] = qkd;
      }
    }
    // This token's q, k, v and sums published. The buffers of token t - 1 (the other parity) may
    // still be read behind this barrier; those of t - 2 (this parity) no longer: every thread
    // passed the previous token's second barrier.
    __syncthreads();
    float qq = 0.0f, kk = 0.0f, qkd = 0.0f;
#pragma unroll
    for (uint w = 0; w < DNG_QK_WARPS; ++w) {
      qq += part[0][w];
      kk += part[1][w];
      qkd += part[2][w];
    }
    const float q_inv = rsqrtf(qq + 1e-6f) * q_scale, k_inv = rsqrtf(kk + 1e-6f);
    const float beta = sigmoid(bt), alpha = expf(decay_rate * softplus(at + dtb));
    float pk = 0.0f, pq = 0.0f;
#pragma unroll
    for (uint i = 0; i < DNG_NR; ++i) {
      const uint d = rg + DNG_RW * i;
      if (d < Dk) {
        pk += s[i] * kn[bf][d];
        pq += s[i] * qs[bf][d];
      }
    }
    red[0][tid] = pk;
    red[1][tid] = pq;
    const float v = col ? vs[bf][lane] : 0.0f;
    // The partial sums published (and every read of part done: the next token rewrites it).
    __syncthreads();
    float sk = 0.0f, sq = 0.0f;
#pragma unroll
    for (uint r = 0; r < DNG_RW; ++r) {
      sk += red[0][r * 32 + lane];
      sq += red[1][r * 32 + lane];
    }
    // red is rewritten after the next token's first barrier, which every thread reaches after this.
    const float delta = beta * (v - alpha * k_inv * sk), kd = k_inv * delta;
#pragma unroll
    for (uint i = 0; i < DNG_NR; ++i) {
      const uint d = rg + DNG_RW * i;
      if (d < Dk) s[i] = alpha * s[i] + kn[bf][d] * kd;
    }
    if (rg == 0) {  // warp 0: the block's outputs, gated, and their sums of squares
      const float o = col ? q_inv * (alpha * sq + kd * qkd) : 0.0f;
      if (col) out[o_at] = o * wn * silu(zt);
      const float oo = warp_sum(o * o);
      if (lane == 0) core[((size_t)t * Hv + j) * gridDim.y + blockIdx.y] = oo;
    }
    if (++t == T) break;
    inputs(t);
  }
  // S is read by no other block of this launch: stored after the count (last_block), outside its fences.
  const bool is_last = last_block(&counts[kh], per * gridDim.y, last);
#pragma unroll
  for (uint i = 0; i < DNG_NR; ++i) {
    const uint d = rg + DNG_RW * i;
    if (col && d < Dk) S[d * Dv + c] = s[i];
  }
  // The new conv state: the window ends at row T - 1; state row hist - 1 - k = row T - 1 - k. The v
  // channels are this block's alone; the q/k channels are written by the last block of kh, every
  // block of which has read their old state by then.
  const bool qk_last = qk && is_last;
#pragma unroll
  for (uint k = 0; k + 1 < DNG_W; ++k) {
    if (k >= hist) continue;
    float* row = conv_state + (size_t)(hist - 1 - k) * C;
    if (vch || qk_last) row[ch0] = win0[DNG_W - 1 - k];
    if (qk_last) row[ch1] = win1[DNG_W - 1 - k];
  }
  if (!is_last) return;  // whole block
  // The gated norm of kh's value heads: out *= 1 / sqrt(mean(o^2) + eps), through L2 (volatile:
  // other blocks of this launch wrote them; never a stale L1 line).
  const uint n = per * Dv;
  for (uint e = tid; e < T * n; e += DNG_THREADS) {
    const uint t = e / n, jj = kh * per + (e % n) / Dv;
    const volatile float* sums = core + ((size_t)t * Hv + jj) * gridDim.y;
    float ss = 0.0f;
    for (uint q = 0; q < gridDim.y; ++q) ss += sums[q];
    volatile float* o = out + ((size_t)t * Hv + jj) * Dv + e % Dv;
    *o = *o * rsqrtf(ss / (float)Dv + np.eps);
  }
}
