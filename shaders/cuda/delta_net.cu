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
// [T, Hv Dv], state [Hv, Dk, Dv] f32 (in/out), counts [Hk] u32 (zero; left zero). Dk, Dv <= 128.
// Arguments: DeltaNetParams p, ConvParams cp (channels C, taps), RmsNormParams np (eps), conv_w,
// conv_state, proj, a, b, a_log, dt_bias, norm_w, z, state, out, counts.
// Grid (Hv), 512 threads = 16 warps: block j is value head j, key head kh = j / (Hv / Hk).
// - Conv: thread i < Dk owns q channel i of key head kh, Dk <= i < 2 Dk its k channel i - Dk, and
//   thread 2 DNG_DK + c the v channel c of head j; each keeps its channel's last taps rows in a
//   register window across the T tokens (as delta_net_conv with one tile) and puts each token's
//   silu(conv) in shared memory (qs, kn, vs).
// - Recurrence: warp w holds columns c = 32 (w % 4) + lane and rows d = w / 4 + 4 i of S_j in
//   registers for all T tokens (delta_net's layout, the 4 column blocks of a head in one block);
//   S^T k and S^T q are summed over the 4 row warps of a column through shared memory.
// - Norm: the head's Dv outputs are in the block (warps 0-3): one block_sum of their squares,
//   then out = o / rms * norm_w * silu(z).
// Conv state ownership (each channel updated exactly once, never read after another block updated
// it): the v channels of head j are read and written by block j alone, after its reads. The q/k
// channels of key head kh are read by the Hv / Hk blocks of its value heads; each block, done with
// its reads, counts itself on counts[kh] (a device-scope fence, then atomicAdd; last-block-done as
// moe_router), and the last one writes their new state and sets the count back to 0. f32 throughout.
#define DNG_DK DELTA_NET_GATED_DIM_MAX // Dk and Dv at most
#define DNG_THREADS 512 // 4 column warps x 4 row warps of 32 lanes
#define DNG_ROWS (DNG_DK / 4)
extern "C" __global__ void __launch_bounds__(DNG_THREADS) delta_net_gated(const DeltaNetParams p, const ConvParams cp,
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
                                                                         float* __restrict__ out, uint* __restrict__ counts) {
  kernel_start();
  __shared__ float qs[DNG_DK];
  __shared__ float kn[DNG_DK];
  __shared__ float vs[DNG_DK];
  __shared__ float red[DNG_THREADS];
  __shared__ float partial[32];
  __shared__ uint last[1];
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim, T = p.tokens;
  const uint C = cp.channels, taps = cp.taps, hist = taps - 1;
  const uint j = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint kh = j / (Hv / Hk);
  // This thread's conv channel (C: none) and where its output goes.
  uint ch = C;
  float* dst = vs;
  if (tid < Dk) {
    ch = kh * Dk + tid;
    dst = qs + tid;
  } else if (tid < 2 * Dk) {
    ch = Hk * Dk + kh * Dk + (tid - Dk);
    dst = kn + (tid - Dk);
  } else if (tid >= 2 * DNG_DK && tid < 2 * DNG_DK + Dv) {
    ch = 2 * Hk * Dk + j * Dv + (tid - 2 * DNG_DK);
    dst = vs + (tid - 2 * DNG_DK);
  }
  const bool conv = ch < C, qk = tid < 2 * Dk;
  // Window as delta_net_conv's, of W = DELTA_NET_GATED_TAPS_MAX (the host checks taps <= W):
  // win[W - 1 - k] holds row t - k (rows -hist .. -1 are the state), wr[W - 1 - k] = w[ch, taps - 1 - k]
  // (0 for k >= taps). Every read of the old conv state happens here, before any write.
  float win[DELTA_NET_GATED_TAPS_MAX], wr[DELTA_NET_GATED_TAPS_MAX];
#pragma unroll
  for (uint i = 0; i < DELTA_NET_GATED_TAPS_MAX; ++i) {
    const uint k = DELTA_NET_GATED_TAPS_MAX - 1 - i;
    wr[i] = conv && k < taps ? conv_w[(size_t)ch * taps + (taps - 1 - k)] : 0.0f;
    win[i] = conv && k < hist ? conv_state[(size_t)(hist - 1 - k) * C + ch] : 0.0f;
  }
  const uint cg = warp % 4, rg = warp / 4, c = 32 * cg + lane;
  const bool col = c < Dv;
  float* S = state + (size_t)j * Dk * Dv;
  float s[DNG_ROWS];  // rows rg + 4 i; indexed only by unrolled loops: registers
#pragma unroll
  for (uint i = 0; i < DNG_ROWS; ++i) {
    const uint d = rg + 4 * i;
    s[i] = col && d < Dk ? S[(size_t)d * Dv + c] : 0.0f;
  }
  const float q_scale = rsqrtf((float)Dk), decay_rate = -expf(a_log[j]), dtb = dt_bias[j];
  const float wn = col ? norm_w[c] : 0.0f;
  for (uint t = 0; t < T; ++t) {
    const size_t o_at = ((size_t)t * Hv + j) * Dv + c;
    const float zt = rg == 0 && col ? z[o_at] : 0.0f;
    const float bt = b[(size_t)t * Hv + j], at = a[(size_t)t * Hv + j];
    float y = 0.0f;
    if (conv) {
#pragma unroll
      for (uint i = 0; i + 1 < DELTA_NET_GATED_TAPS_MAX; ++i) win[i] = win[i + 1];
      win[DELTA_NET_GATED_TAPS_MAX - 1] = proj[(size_t)t * C + ch];
      float acc = 0.0f;
#pragma unroll
      for (uint i = 0; i < DELTA_NET_GATED_TAPS_MAX; ++i) acc += wr[i] * win[i];
      y = silu(acc);
      *dst = y;
    }
    const float q_inv = rsqrtf(block_sum(tid < Dk ? y * y : 0.0f, partial) + 1e-6f) * q_scale;
    // block_sum's barriers also publish qs, kn and vs
    const float k_inv = rsqrtf(block_sum(qk && tid >= Dk ? y * y : 0.0f, partial) + 1e-6f);
    const float beta = sigmoid(bt), alpha = expf(decay_rate * softplus(at + dtb));
    float pred = 0.0f;
#pragma unroll
    for (uint i = 0; i < DNG_ROWS; ++i) {
      const uint d = rg + 4 * i;
      if (d < Dk) {
        s[i] *= alpha;
        pred += s[i] * kn[d];
      }
    }
    red[tid] = pred;
    __syncthreads();
    pred = 0.0f;
#pragma unroll
    for (uint r = 0; r < 4; ++r) pred += red[(4 * r + cg) * 32 + lane];
    const float delta = beta * ((col ? vs[c] : 0.0f) - pred * k_inv);
    float o = 0.0f;
#pragma unroll
    for (uint i = 0; i < DNG_ROWS; ++i) {
      const uint d = rg + 4 * i;
      if (d < Dk) {
        s[i] += kn[d] * k_inv * delta;
        o += s[i] * qs[d];
      }
    }
    __syncthreads();  // every warp has read red (pred) before it is overwritten
    red[tid] = o;
    __syncthreads();
    o = 0.0f;
#pragma unroll
    for (uint r = 0; r < 4; ++r) o += red[(4 * r + cg) * 32 + lane];
    o *= q_inv;
    // The gated norm over the head's Dv columns (warps 0-3 hold each once). Its barriers also
    // order this token's reads of qs, kn, vs and red before the next token's writes.
    const float inv = rsqrtf(block_sum(rg == 0 && col ? o * o : 0.0f, partial) / (float)Dv + np.eps);
    if (rg == 0 && col) out[o_at] = o * inv * wn * silu(zt);
  }
#pragma unroll
  for (uint i = 0; i < DNG_ROWS; ++i) {
    const uint d = rg + 4 * i;
    if (col && d < Dk) S[(size_t)d * Dv + c] = s[i];
  }
  // The new conv state: the window ends at row T - 1; state row hist - 1 - k = row T - 1 - k.
  auto store_conv = [&]() {
#pragma unroll
    for (uint k = 0; k + 1 < DELTA_NET_GATED_TAPS_MAX; ++k)
      if (k < hist) conv_state[(size_t)(hist - 1 - k) * C + ch] = win[DELTA_NET_GATED_TAPS_MAX - 1 - k];
  };
  if (conv && !qk) store_conv();  // v channels: this block's alone
  __syncthreads();                // every read of the q/k state in this block is done (consumed)
  if (tid == 0) {
    __threadfence();
    last[0] = atomicAdd(&counts[kh], 1u) == Hv / Hk - 1 ? 1u : 0u;
    if (last[0]) counts[kh] = 0u;  // every block of this key head has counted
  }
  __syncthreads();
  if (last[0] && conv && qk) store_conv();
}
