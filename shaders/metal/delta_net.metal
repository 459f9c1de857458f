// Gated DeltaNet (GDN): the causal depthwise conv and the delta-rule recurrence (host:
// ops/delta_net/metal.rs).
#include "common.h"

// delta_net_conv: out [T, C] = silu(sum_j w[c, j] * row(t + j)) over the rows of [state; x],
// state [taps - 1, C] (oldest first) becomes the last taps - 1 rows; w [C, taps], x [T, C] f32.
// Bindings: 0 ConvParams, 1 w, 2 state (in/out), 3 x, 4 out. Grid: dispatchThreads (C),
// threadgroups of 64: one thread per channel walks the T tokens keeping the history in registers
// (1 <= taps <= MAX_CONV_TAPS, checked when the config is read).
kernel void delta_net_conv_f32(constant ConvParams& p [[buffer(0)]], device const float* w [[buffer(1)]],
                               device float* state [[buffer(2)]], device const float* x [[buffer(3)]],
                               device float* out [[buffer(4)]], uint c [[thread_position_in_grid]]) {
  if (c >= p.channels) return;
  const uint hist = p.taps - 1, C = p.channels;
  float h[MAX_CONV_TAPS - 1];
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
// column c = 4 tg.x + s; lane holds S[d, c] for d = lane + 32 i (Dk <= DELTA_NET_KEY_DIM_MAX) in
// registers for all
// T steps, so the state is read and written once per call. Recurrence and reductions in f32.
// Used for decode and short prefills; from one chunk of tokens on, the host runs the chunked
// form instead (delta_net_chunk_prep_f32 + delta_net_chunk_f32 below).
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
  float s[DELTA_NET_KEY_DIM_MAX / 32];
  for (uint i = 0; i < nd; ++i) {
    const uint d = lane + 32 * i;
    s[i] = d < Dk ? S[(ulong)d * Dv + c] : 0.0f;
  }
  const float q_scale = 1.0f / metal::precise::sqrt(float(Dk));
  const float decay_rate = -metal::precise::exp(a_log[j]);
  for (uint t = 0; t < p.tokens; ++t) {
    device const float* row = qkv + (ulong)t * width;
    float q[DELTA_NET_KEY_DIM_MAX / 32], k[DELTA_NET_KEY_DIM_MAX / 32];
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

// ------------------------------------------------------------------ decode: conv + recurrence + gated norm
// delta_net_gated: a decode step's DeltaNet core in one dispatch, T tokens of one sequence (the host
// takes it up to GATED_TOKENS, ops/delta_net/metal.rs): out =
// rms_norm_gated(delta_net(delta_net_conv(proj)), z), delta_net_conv_f32, delta_net_f32 and
// norm.metal's rms_norm_gated_f32 composed, without their round trips through device memory.
// proj [T, C] (q | k | v before the conv, C = 2 Hk Dk + Hv Dv), conv_w [C, taps], conv_state
// [taps - 1, C] (oldest first, in/out), a / b [T, Hv], a_log / dt_bias [Hv], norm_w [Dv], z / out
// [T, Hv Dv], state [Hv, Dk, Dv] f32 (in/out). Dk <= DELTA_NET_KEY_DIM_MAX.
// Bindings: 0 DeltaNetParams, 1 ConvParams (channels C, taps), 2 RmsNormParams (eps), 3 conv_w,
// 4 conv_state, 5 proj, 6 a, 7 b, 8 a_log, 9 dt_bias, 10 norm_w, 11 z, 12 state, 13 out;
// threadgroup memory 0: qk [T][2 Dk] (this key head's q | k after the conv, then l2-normed), 1: vo
// [T][G Dv] (its value heads' v after the conv, then each column's recurrence output o in the same
// slot), 2: gates [T][2 G] (alpha = e^g, beta); the host checks they fit in 32 KiB.
// Grid: threadgroups (Hk), 1024 threads = 32 simdgroups: threadgroup kh is key head kh with its
// G = Hv / Hk value heads j = kh G .. kh G + G - 1 (contiguous, as j / G = kh).
// Why one threadgroup per key head: the q/k conv channels (and their conv state) of a key head are
// shared by its G value heads. With one threadgroup per value head (CUDA's grid), the G threadgroups
// would each read the old q/k conv state and one of them must write the new state only after all
// have read it (CUDA: a device-scope counter, last block done). Here every conv channel, its
// state included, belongs to exactly one threadgroup and one thread, so no threadgroup ever waits
// on another and the conv state needs no barrier at all; the model's 16 key heads give 16
// threadgroups, each streaming 2 x 64 KiB of recurrent state.
// - Conv: thread i strides over the 2 Dk + G Dv channels of the key head; for each token it sums
//   taps rows of [conv_state; proj] read straight from device memory (neither is written before
//   the thread's own last read of its channel), writes silu into qk / vo, then stores its
//   channel's new state (row r <- row T + r of [state; proj], r ascending: a row is overwritten
//   only after it was read). Threads below 2 T G compute the gates of one (token, value head).
// - Norms of q and k: simdgroup s takes the rows (t, q|k) = s, s + 32, ...: simd_sum of squares,
//   then the row scaled in place (q also by 1 / sqrt(Dk)).
// - Recurrence: simdgroup s owns the columns c = s, s + 32, ... of the G Dv (head g = c / Dv,
//   column c % Dv); lane holds S_j[d, c % Dv] for d = lane + 32 i in registers through the T tokens
//   (delta_net_f32's layout): S <- alpha S; delta = beta (v - S^T k); S += k delta; o = S^T q
//   (simd_sum); lane 0 puts o where v was (every lane has read v before the first simd_sum).
// - Gated norm: simdgroup s takes the rows (t, g) = s, s + 32, ...: rms over the Dv outputs,
//   out = o / rms * norm_w * silu(z).
// Three threadgroup barriers in all (not per token). f32 throughout.
// Row r of [conv_state; proj] in channel ch (r < hist: the state).
inline float dng_conv_row(device const float* conv_state, device const float* proj, uint r, uint hist, uint C,
                          uint ch) {
  return r < hist ? conv_state[(ulong)r * C + ch] : proj[(ulong)(r - hist) * C + ch];
}
kernel void delta_net_gated_f32(constant DeltaNetParams& p [[buffer(0)]], constant ConvParams& cp [[buffer(1)]],
                                constant RmsNormParams& np [[buffer(2)]], device const float* conv_w [[buffer(3)]],
                                device float* conv_state [[buffer(4)]], device const float* proj [[buffer(5)]],
                                device const float* a [[buffer(6)]], device const float* b [[buffer(7)]],
                                device const float* a_log [[buffer(8)]], device const float* dt_bias [[buffer(9)]],
                                device const float* norm_w [[buffer(10)]], device const float* z [[buffer(11)]],
                                device float* state [[buffer(12)]], device float* out [[buffer(13)]],
                                threadgroup float* qk [[threadgroup(0)]], threadgroup float* vo [[threadgroup(1)]],
                                threadgroup float* gates [[threadgroup(2)]],
                                uint kh [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                                uint ntg [[threads_per_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim, T = p.tokens;
  const uint C = cp.channels, taps = cp.taps, hist = taps - 1;
  const uint G = Hv / Hk, GD = G * Dv, j0 = kh * G;
  // Conv, channel by channel. Local channel i: q (i < Dk), k (i < 2 Dk), else v column i - 2 Dk of
  // the key head's value heads; ch its place in proj's rows, dst / ld where its outputs go.
  for (uint i = tid; i < 2 * Dk + GD; i += ntg) {
    uint ch = 0, ld = 0;
    threadgroup float* dst = qk;
    if (i < 2 * Dk) {
      ch = (i < Dk ? 0u : Hk * Dk - Dk) + kh * Dk + i;
      dst = qk + i;
      ld = 2 * Dk;
    } else {
      ch = 2 * Hk * Dk + j0 * Dv + (i - 2 * Dk);
      dst = vo + (i - 2 * Dk);
      ld = GD;
    }
    device const float* w = conv_w + (ulong)ch * taps;
    for (uint t = 0; t < T; ++t) {
      float acc = 0.0f;
      for (uint m = 0; m < taps; ++m) acc += w[m] * dng_conv_row(conv_state, proj, t + m, hist, C, ch);
      dst[t * ld] = silu(acc);
    }
    for (uint r = 0; r < hist; ++r) conv_state[(ulong)r * C + ch] = dng_conv_row(conv_state, proj, T + r, hist, C, ch);
  }
  for (uint e = tid; e < T * G; e += ntg) {
    const uint t = e / G, g = e % G, j = j0 + g;
    gates[t * 2 * G + g] =
        metal::precise::exp(-metal::precise::exp(a_log[j]) * softplus(a[t * Hv + j] + dt_bias[j]));
    gates[t * 2 * G + G + g] = sigmoid(b[t * Hv + j]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // l2 norms of each token's q and k (row 2 t: q, 2 t + 1: k).
  const float q_scale = 1.0f / metal::precise::sqrt(float(Dk));
  for (uint r = sg; r < 2 * T; r += nsg) {
    threadgroup float* x = qk + r * Dk;
    float ss = 0.0f;
    for (uint d = lane; d < Dk; d += 32) ss += x[d] * x[d];
    const float inv = 1.0f / metal::precise::sqrt(simd_sum(ss) + 1e-6f) * (r % 2 == 0 ? q_scale : 1.0f);
    for (uint d = lane; d < Dk; d += 32) x[d] *= inv;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // The recurrence, a column per simdgroup at a time.
  const uint nd = (Dk + 31) / 32;
  for (uint c = sg; c < GD; c += nsg) {
    const uint g = c / Dv, cc = c % Dv;
    device float* S = state + (ulong)(j0 + g) * Dk * Dv;
    float s[DELTA_NET_KEY_DIM_MAX / 32];
    for (uint i = 0; i < nd; ++i) {
      const uint d = lane + 32 * i;
      s[i] = d < Dk ? S[(ulong)d * Dv + cc] : 0.0f;
    }
    for (uint t = 0; t < T; ++t) {
      threadgroup const float* q = qk + 2 * t * Dk;
      threadgroup const float* k = q + Dk;
      const float alpha = gates[t * 2 * G + g], beta = gates[t * 2 * G + G + g];
      const float v = vo[t * GD + c];
      float pred = 0.0f;
      for (uint i = 0; i < nd; ++i) {
        const uint d = lane + 32 * i;
        s[i] *= alpha;
        pred += d < Dk ? s[i] * k[d] : 0.0f;
      }
      const float delta = beta * (v - simd_sum(pred));
      float o = 0.0f;
      for (uint i = 0; i < nd; ++i) {
        const uint d = lane + 32 * i;
        if (d < Dk) {
          s[i] += k[d] * delta;
          o += s[i] * q[d];
        }
      }
      o = simd_sum(o);
      if (lane == 0) vo[t * GD + c] = o;
    }
    for (uint i = 0; i < nd; ++i) {
      const uint d = lane + 32 * i;
      if (d < Dk) S[(ulong)d * Dv + cc] = s[i];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // The gated norm of each (token, value head) row of Dv outputs.
  for (uint r = sg; r < T * G; r += nsg) {
    const uint t = r / G, g = r % G;
    threadgroup const float* o = vo + t * GD + g * Dv;
    float ss = 0.0f;
    for (uint c = lane; c < Dv; c += 32) ss += o[c] * o[c];
    const float inv = 1.0f / metal::precise::sqrt(simd_sum(ss) / float(Dv) + np.eps);
    for (uint c = lane; c < Dv; c += 32) {
      const ulong at = ((ulong)t * Hv + j0 + g) * Dv + c;
      out[at] = o[c] * inv * norm_w[c] * silu(z[at]);
    }
  }
}

// ------------------------------------------------------------------ chunked prefill
// The chunked (WY / UT-transform) form of the same recurrence (architecture.md 6.1), in chunks of
// DELTA_NET_CHUNK = 32 tokens: one token per lane of a simdgroup, [32, 32] intra-chunk matrices of 4 KiB
// (a 64-token chunk would need 16 KiB per matrix and overflow the 32 KiB of threadgroup memory
// with the staging tiles). Per value head j and chunk (n <= 32 tokens; the rows past n are zero
// with beta = g = 0, so they are no-ops), with q, k l2-normed (q / sqrt(Dk)), incoming state S:
//   gam_i = sum_{s <= i} g_s, D[i, s] = e^(gam_i - gam_s) (s <= i), A = strict-lower(beta_i (k_i . k_s) D)
//   T = (I + A)^-1, W = T diag(beta e^gam) K, U = T diag(beta) V, M = lower(Q K^T . D)
//   V' = U - W S; O = diag(e^gam) Q S + M V'; S <- e^gam_n S + (diag(e^(gam_n - gam)) K)^T V'
// Two kernels: delta_net_chunk_prep_f32 builds every chunk's matrices in parallel (grid over
// chunks x heads) into a scratch buffer; delta_net_chunk_f32 carries the state through the
// chunks in order, a block of value columns per threadgroup. Only exponentials of non-positive
// numbers appear. f32 throughout (simdgroup_float8x8 products accumulate in f32).
//
// Scratch: one block per (value head j, chunk c) at (j * chunks + c) * block floats,
// Dkp = Dk and Dvp = Dv rounded up to 32 (padding columns hold zeros):
//   -W [32, Dkp] | Qg = diag(e^gam) Q [32, Dkp] | Kd = diag(e^(gam_n - gam)) K [32, Dkp] |
//   U [32, Dvp] | M [32, 32] | e^gam_n, 3 floats of padding
// block = 32 (3 Dkp + Dvp + 32) + 4 (the host sizes it with the same formula: delta_net_block).

struct DnLayout {
  uint dkp, dvp, chunks;
  ulong block;
  ulong w() const { return 0; }
  ulong qg() const { return (ulong)DELTA_NET_CHUNK * dkp; }
  ulong kd() const { return 2ul * DELTA_NET_CHUNK * dkp; }
  ulong u() const { return 3ul * DELTA_NET_CHUNK * dkp; }
  ulong m() const { return u() + (ulong)DELTA_NET_CHUNK * dvp; }
  ulong decay() const { return m() + DELTA_NET_CHUNK * DELTA_NET_CHUNK; }
};

inline DnLayout dn_layout(uint tokens, uint key_dim, uint value_dim) {
  DnLayout l;
  l.dkp = (key_dim + 31) / 32 * 32;
  l.dvp = (value_dim + 31) / 32 * 32;
  l.chunks = (tokens + DELTA_NET_CHUNK - 1) / DELTA_NET_CHUNK;
  l.block = (ulong)DELTA_NET_CHUNK * (3 * l.dkp + l.dvp + DELTA_NET_CHUNK) + 4;
  return l;
}

// delta_net_chunk_prep: the intra-chunk matrices of one (chunk, value head), written to its
// scratch block (layout above). qkv/a/b/a_log/dt_bias as delta_net_f32. Bindings: 0
// DeltaNetParams, 1 qkv, 2 a, 3 b, 4 a_log, 5 dt_bias, 6 scratch (out); threadgroup memory
// 0: 4 x 32 floats (per-row q scale, k scale, beta, gam), 1: 2 x [32][32] staging tiles (a 32-column
// slice of K and of Q, or of V), 2: 2 x [32][32] matrices (K K^T -> A -> -T diag(beta e^gam);
// Q K^T -> T -> T diag(beta)); 16.5 KiB in all. Grid: threadgroups (chunks, Hv), 128 threads =
// 4 simdgroups. Steps: row norms (simdgroup s takes rows s, s + 4, ...; lanes over Dk), beta
// and the cumulative decay (simdgroup 0, lane = row, simd_prefix_inclusive_sum); K K^T and Q K^T
// over 32-column slices of the staged (normalized) K and Q, simdgroup s owning 8-row tile s of
// the lower triangle (8x8 simdgroup matrices); A and M elementwise (M stored); T by forward
// substitution (simdgroup 0, lane = column of T); then per 32-column slice, Qg and Kd
// elementwise and W = T' K, U = T'' V on simdgroup matrices (simdgroup s: rows 8s..8s+8),
// stored straight into the scratch. Accumulation: f32.
kernel void delta_net_chunk_prep_f32(constant DeltaNetParams& p [[buffer(0)]], device const float* qkv [[buffer(1)]],
                                     device const float* a [[buffer(2)]], device const float* b [[buffer(3)]],
                                     device const float* a_log [[buffer(4)]],
                                     device const float* dt_bias [[buffer(5)]], device float* scratch [[buffer(6)]],
                                     threadgroup float* rows [[threadgroup(0)]],
                                     threadgroup float* stage [[threadgroup(1)]],
                                     threadgroup float* mats [[threadgroup(2)]],
                                     uint2 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                                     uint sg [[simdgroup_index_in_threadgroup]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint C = DELTA_NET_CHUNK;
  const uint Hk = p.key_heads, Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim;
  const uint ch = tg.x, j = tg.y;
  const uint kh = j / (Hv / Hk);
  const uint width = 2 * Hk * Dk + Hv * Dv;
  const uint t0 = ch * C;
  const uint n = min(C, p.tokens - t0);
  const DnLayout L = dn_layout(p.tokens, Dk, Dv);
  device float* blk = scratch + ((ulong)j * L.chunks + ch) * L.block;
  threadgroup float* row_q = rows;           // 1 / (|q_i| sqrt(Dk)), 0 past n
  threadgroup float* row_k = rows + C;       // 1 / |k_i|, 0 past n
  threadgroup float* beta = rows + 2 * C;    // 0 past n
  threadgroup float* gam = rows + 3 * C;     // cumulative log-decay (g = 0 past n)
  threadgroup float* ks = stage;             // [32 rows][32 columns]
  threadgroup float* qs = stage + C * 32;    // [32 rows][32 columns]
  threadgroup float* am = mats;              // [32][32]
  threadgroup float* xm = mats + C * C;      // [32][32]
  device const float* q_in = qkv + (ulong)t0 * width + kh * Dk;
  device const float* k_in = qkv + (ulong)t0 * width + Hk * Dk + kh * Dk;
  device const float* v_in = qkv + (ulong)t0 * width + 2 * Hk * Dk + j * Dv;

  // Row norms, beta, cumulative decay.
  const float q_scale = 1.0f / metal::precise::sqrt(float(Dk));
  for (uint i = sg; i < C; i += 4) {
    float qq = 0.0f, kk = 0.0f;
    if (i < n) {
      for (uint d = lane; d < Dk; d += 32) {
        const float qv = q_in[(ulong)i * width + d], kv = k_in[(ulong)i * width + d];
        qq += qv * qv;
        kk += kv * kv;
      }
    }
    qq = simd_sum(qq);
    kk = simd_sum(kk);
    if (lane == 0) {
      row_q[i] = i < n ? q_scale / metal::precise::sqrt(qq + 1e-6f) : 0.0f;
      row_k[i] = i < n ? 1.0f / metal::precise::sqrt(kk + 1e-6f) : 0.0f;
    }
  }
  if (sg == 0) {
    const uint i = lane;
    float bt = 0.0f, g = 0.0f;
    if (i < n) {
      bt = sigmoid(b[(t0 + i) * Hv + j]);
      g = -metal::precise::exp(a_log[j]) * softplus(a[(t0 + i) * Hv + j] + dt_bias[j]);
    }
    beta[i] = bt;
    gam[i] = simd_prefix_inclusive_sum(g);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Staging: thread tid fills columns sc .. sc + 8 of tile row sr.
  const uint sr = tid / 4, sc = (tid % 4) * 8;
  // K K^T and Q K^T, lower 8x8 tiles (sg, ct <= sg).
  simdgroup_float8x8 gk[4], gq[4];
  for (uint ct = 0; ct < 4; ++ct) {
    gk[ct] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    gq[ct] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (uint d0 = 0; d0 < Dk; d0 += 32) {
    for (uint e = 0; e < 8; ++e) {
      const uint d = d0 + sc + e;
      const bool in = sr < n && d < Dk;
      ks[sr * 32 + sc + e] = in ? k_in[(ulong)sr * width + d] * row_k[sr] : 0.0f;
      qs[sr * 32 + sc + e] = in ? q_in[(ulong)sr * width + d] * row_q[sr] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < 32; kk += 8) {
      simdgroup_float8x8 ka, qa;
      simdgroup_load(ka, ks + 8 * sg * 32 + kk, 32);
      simdgroup_load(qa, qs + 8 * sg * 32 + kk, 32);
      for (uint ct = 0; ct < 4; ++ct) {
        if (ct > sg) continue;
        simdgroup_float8x8 kb;  // kb[x][y] = k[8 ct + y][kk + x]
        simdgroup_load(kb, ks + 8 * ct * 32 + kk, 32, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(gk[ct], ka, kb, gk[ct]);
        simdgroup_multiply_accumulate(gq[ct], qa, kb, gq[ct]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint ct = 0; ct < 4; ++ct) {
    if (ct > sg) continue;
    simdgroup_store(gk[ct], am + 8 * sg * C + 8 * ct, C);
    simdgroup_store(gq[ct], xm + 8 * sg * C + 8 * ct, C);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // A (in place over K K^T, zero on and above the diagonal) and M (stored), 8 entries per thread.
  device float* m_out = blk + L.m();
  for (uint e = 0; e < 8; ++e) {
    const uint i = sr, s = sc + e;
    const float dec = s <= i ? metal::precise::exp(min(gam[i] - gam[s], 0.0f)) : 0.0f;
    am[i * C + s] = s < i ? beta[i] * am[i * C + s] * dec : 0.0f;
    m_out[i * C + s] = s <= i ? xm[i * C + s] * dec : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // T = (I + A)^-1 into xm by forward substitution: lane c computes column c (rows above the
  // diagonal 0); it reads rows of A and only its own column of T.
  if (sg == 0) {
    const uint c = lane;
    for (uint i = 0; i < C; ++i) {
      float x = i == c ? 1.0f : 0.0f;
      for (uint s = c; s < i; ++s) x -= am[i * C + s] * xm[s * C + c];
      xm[i * C + c] = x;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // am <- -T diag(beta e^gam), xm <- T diag(beta).
  for (uint e = 0; e < 8; ++e) {
    const uint i = sr, s = sc + e;
    const float x = xm[i * C + s] * beta[s];
    am[i * C + s] = -x * metal::precise::exp(gam[s]);
    xm[i * C + s] = x;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Per 32-column slice of K and Q: Qg, Kd elementwise, -W = am K (lower-triangular am: only
  // k-tiles kt <= sg).
  const float gam_n = gam[C - 1];
  const float eq = metal::precise::exp(gam[sr]), ek = metal::precise::exp(gam_n - gam[sr]);
  for (uint d0 = 0; d0 < L.dkp; d0 += 32) {
    for (uint e = 0; e < 8; ++e) {
      const uint d = d0 + sc + e;
      const bool in = sr < n && d < Dk;
      const float kv = in ? k_in[(ulong)sr * width + d] * row_k[sr] : 0.0f;
      const float qv = in ? q_in[(ulong)sr * width + d] * row_q[sr] : 0.0f;
      ks[sr * 32 + sc + e] = kv;
      blk[L.qg() + sr * L.dkp + d] = qv * eq;
      blk[L.kd() + sr * L.dkp + d] = kv * ek;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint ct = 0; ct < 4; ++ct) {
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint kt = 0; kt <= sg; ++kt) {
        simdgroup_float8x8 ta, kb;
        simdgroup_load(ta, am + 8 * sg * C + 8 * kt, C);
        simdgroup_load(kb, ks + 8 * kt * 32 + 8 * ct, 32);
        simdgroup_multiply_accumulate(acc, ta, kb, acc);
      }
      simdgroup_store(acc, blk + L.w() + (ulong)8 * sg * L.dkp + d0 + 8 * ct, L.dkp);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // Per 32-column slice of V: U = xm V.
  for (uint c0 = 0; c0 < L.dvp; c0 += 32) {
    for (uint e = 0; e < 8; ++e) {
      const uint c = c0 + sc + e;
      ks[sr * 32 + sc + e] = sr < n && c < Dv ? v_in[(ulong)sr * width + c] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint ct = 0; ct < 4; ++ct) {
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint kt = 0; kt <= sg; ++kt) {
        simdgroup_float8x8 ta, vb;
        simdgroup_load(ta, xm + 8 * sg * C + 8 * kt, C);
        simdgroup_load(vb, ks + 8 * kt * 32 + 8 * ct, 32);
        simdgroup_multiply_accumulate(acc, ta, vb, acc);
      }
      simdgroup_store(acc, blk + L.u() + (ulong)8 * sg * L.dvp + c0 + 8 * ct, L.dvp);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) blk[L.decay()] = metal::precise::exp(gam_n);
}

// delta_net_chunk: the state carried through the chunks prepared by delta_net_chunk_prep_f32,
// in order. Bindings: 0 DeltaNetParams, 1 scratch (in), 2 state [Hv, Dk, Dv] f32 (in/out),
// 3 out [T, Hv, Dv]; threadgroup memory 0: S[:, c0 .. c0 + 16] as [Dkp][16] (zero rows past Dk,
// zero columns past Dv; <= 16 KiB for Dk <= 256), 1: V' [32][16], 2: O [32][16] (2 KiB each).
// Grid: threadgroups (ceil(Dv / 16), Hv), 128 threads = 4 simdgroups: value columns
// c0 = 16 tg.x .. c0 + 16 of head tg.y (columns of S evolve independently). The state block is
// read once, kept in threadgroup memory for all chunks and written back once. Per chunk:
// simdgroup s computes rows 8s..8s+8 of V' = U + (-W) S and of Qg S (one pass over the Dkp/8
// k-tiles of S); after a barrier, O += M V' (tiles kt <= s of lower-triangular M) and the
// state row tiles r = s, s + 4, ... (rows 8r..8r+8) are decayed by e^gam_n and updated with
// Kd^T V' (Kd loaded transposed); O leaves through threadgroup memory, bounds-checked. Two
// barriers per chunk. All products on 8x8 simdgroup matrices, f32 accumulation.
kernel void delta_net_chunk_f32(constant DeltaNetParams& p [[buffer(0)]], device const float* scratch [[buffer(1)]],
                                device float* state [[buffer(2)]], device float* out [[buffer(3)]],
                                threadgroup float* st [[threadgroup(0)]], threadgroup float* vp [[threadgroup(1)]],
                                threadgroup float* ob [[threadgroup(2)]], uint2 tg [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint C = DELTA_NET_CHUNK, NC = DELTA_NET_COLS;
  const uint Hv = p.value_heads, Dk = p.key_dim, Dv = p.value_dim;
  const uint c0 = tg.x * NC, j = tg.y;
  const DnLayout L = dn_layout(p.tokens, Dk, Dv);
  const uint nkt = L.dkp / 8;
  device float* S = state + (ulong)j * Dk * Dv;
  for (uint e = tid; e < L.dkp * NC; e += 128) {
    const uint d = e / NC, c = c0 + e % NC;
    st[e] = d < Dk && c < Dv ? S[(ulong)d * Dv + c] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint ch = 0; ch < L.chunks; ++ch) {
    device const float* blk = scratch + ((ulong)j * L.chunks + ch) * L.block;
    // V' = U + (-W) S and Qg S, rows 8 sg .. 8 sg + 8.
    simdgroup_float8x8 v[2], o[2];
    for (uint ct = 0; ct < 2; ++ct) {
      simdgroup_load(v[ct], blk + L.u() + (ulong)8 * sg * L.dvp + c0 + 8 * ct, L.dvp);
      o[ct] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    for (uint kt = 0; kt < nkt; ++kt) {
      simdgroup_float8x8 w, q;
      simdgroup_load(w, blk + L.w() + (ulong)8 * sg * L.dkp + 8 * kt, L.dkp);
      simdgroup_load(q, blk + L.qg() + (ulong)8 * sg * L.dkp + 8 * kt, L.dkp);
      for (uint ct = 0; ct < 2; ++ct) {
        simdgroup_float8x8 s;
        simdgroup_load(s, st + 8 * kt * NC + 8 * ct, NC);
        simdgroup_multiply_accumulate(v[ct], w, s, v[ct]);
        simdgroup_multiply_accumulate(o[ct], q, s, o[ct]);
      }
    }
    for (uint ct = 0; ct < 2; ++ct) simdgroup_store(v[ct], vp + 8 * sg * NC + 8 * ct, NC);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // V' complete; every read of S done
    // O += M V'.
    for (uint kt = 0; kt <= sg; ++kt) {
      simdgroup_float8x8 m;
      simdgroup_load(m, blk + L.m() + 8 * sg * C + 8 * kt, C);
      for (uint ct = 0; ct < 2; ++ct) {
        simdgroup_float8x8 vb;
        simdgroup_load(vb, vp + 8 * kt * NC + 8 * ct, NC);
        simdgroup_multiply_accumulate(o[ct], m, vb, o[ct]);
      }
    }
    for (uint ct = 0; ct < 2; ++ct) simdgroup_store(o[ct], ob + 8 * sg * NC + 8 * ct, NC);
    // S <- e^gam_n S + Kd^T V' on this simdgroup's row tiles.
    const float decay = blk[L.decay()];
    for (uint rt = sg; rt < nkt; rt += 4) {
      threadgroup float* srow = st + 8 * rt * NC;
      for (uint e = lane; e < 8 * NC; e += 32) srow[e] *= decay;
      simdgroup_barrier(mem_flags::mem_threadgroup);
      for (uint ct = 0; ct < 2; ++ct) {
        simdgroup_float8x8 s;
        simdgroup_load(s, srow + 8 * ct, NC);
        for (uint kt = 0; kt < C / 8; ++kt) {
          simdgroup_float8x8 kdt, vb;  // kdt[x][y] = Kd[8 kt + y][8 rt + x]
          simdgroup_load(kdt, blk + L.kd() + (ulong)8 * kt * L.dkp + 8 * rt, L.dkp, ulong2(0, 0), true);
          simdgroup_load(vb, vp + 8 * kt * NC + 8 * ct, NC);
          simdgroup_multiply_accumulate(s, kdt, vb, s);
        }
        simdgroup_store(s, srow + 8 * ct, NC);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // O complete, S updated, V' free
    for (uint e = tid; e < C * NC; e += 128) {
      const uint t = ch * C + e / NC, c = c0 + e % NC;
      if (t < p.tokens && c < Dv) out[((ulong)t * Hv + j) * Dv + c] = ob[e];
    }
  }
  for (uint e = tid; e < L.dkp * NC; e += 128) {
    const uint d = e / NC, c = c0 + e % NC;
    if (d < Dk && c < Dv) S[(ulong)d * Dv + c] = st[e];
  }
}
