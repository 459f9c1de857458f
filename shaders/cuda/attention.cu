// The attention family: q/k norm + RoPE, kv_store and gated GQA attention over a KV cache read
// through a segment table (the 16-bit segmented cache of issue 13: KvDesc in common.cuh; dtype
// f32, bf16 or f16, widened to f32 on read, rounded to nearest even on store). Positions come
// from step[0] (pos0 of this forward call, in device memory so a captured decode graph replays
// at any position). One file: decode attention does the norm + RoPE + store itself.
#include "common.cuh"

// kv_store: cache[pos0 + t, :] = x[t, :] in the cache dtype; x [T, width] f32. Arguments:
// KvStoreParams p (pos0 unused: step[0]), step, KvDesc cache, x. Grid (ceil(width / 256), T).
extern "C" __global__ void kv_store(const KvStoreParams p, const uint* __restrict__ step, const KvDesc d,
                                    const float* __restrict__ x) {
  kernel_start();
  const uint i = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
  if (i >= p.width) return;
  kv_put(d, step[0] + t, i, x[(size_t)t * p.width + i]);
}

// 16 bytes of a cache row (4 f32 or 8 16-bit values) widened to f32 into dst.
__device__ __forceinline__ void kv_widen(uint dtype, const uint4 v, float* dst) {
  const uint w[4] = {v.x, v.y, v.z, v.w};
  if (dtype == 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) dst[j] = __uint_as_float(w[j]);
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const ushort lo = (ushort)(w[j] & 0xffffu), hi = (ushort)(w[j] >> 16);
    dst[2 * j] = dtype == 1 ? bf16_float(lo) : f16_float(lo);
    dst[2 * j + 1] = dtype == 1 ? bf16_float(hi) : f16_float(hi);
  }
}

// The 16 bytes of K and V cache row `row` from column c on (same dtype and segment size), the
// segment table and the rows through L2 only (load_l2: the decode attention loads its first stage
// before its grid_dep_wait()).
__device__ __forceinline__ void kv_load16(const KvDesc kd, const KvDesc vd, uint row, uint c, uint4& k, uint4& v) {
  const size_t at = ((size_t)(row & ((1u << kd.seg_shift) - 1)) * kd.width + c) * (kd.dtype == 0 ? 4 : 2);
  const uchar* kb = reinterpret_cast<const uchar*>(load_l2(reinterpret_cast<const u64*>(kd.seg) + (row >> kd.seg_shift)));
  const uchar* vb = reinterpret_cast<const uchar*>(load_l2(reinterpret_cast<const u64*>(vd.seg) + (row >> vd.seg_shift)));
  k = load_l2(reinterpret_cast<const uint4*>(kb + at));
  v = load_l2(reinterpret_cast<const uint4*>(vb + at));
}

// ---------------------------------------------------------------- q/k norm + RoPE (+ the cache store)
// qk_norm_rope: per-head RMSNorm (weight already 1 + w) then partial rotate-half RoPE on dims
// 0..rotary_dim at position pos0 + t, in place, for q inside qg [T, H, 2*hd] (q = the first hd
// values of each head) and k [T, Hkv, hd]. inv_freq_j = theta^(-2j/rotary_dim); angles in f32.
// pos0 is read from step[0] (device memory, so a captured decode graph replays at any position);
// RopeParams.pos0 is not used. Arguments: RopeParams p, step [1] u32, q_norm [hd], k_norm [hd],
// qg (in/out), k (in/out). Grid (H + Hkv, T): heads 0..H-1 are q heads, then the k heads;
// 128 threads striding over hd (<= 1024), normed values staged in shared memory.
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

// The angle of rotated dim i (< rotary_dim) at position pos: rotate-half RoPE's frequencies.
__device__ __forceinline__ float rope_angle(const RopeParams p, uint i, float pos) {
  const float inv_freq = powf(p.theta, -2.0f * (float)(i % (p.rotary_dim / 2)) / (float)p.rotary_dim);
  return pos * inv_freq;
}

// Value i (< rotary_dim) of head v rotated by (c, s): rotate-half pairs dim i with i +- rotary_dim / 2.
__device__ __forceinline__ float rope_rotate(const float* v, uint i, uint half_rot, float c, float s) {
  return i < half_rot ? v[i] * c - v[i + half_rot] * s : v[i] * c + v[i - half_rot] * s;
}

// Value i of the staged head v after partial rotate-half RoPE at position pos.
__device__ __forceinline__ float rope_at(const RopeParams p, const float* v, uint i, float pos) {
  if (i >= p.rotary_dim) return v[i];
  float s, c;
  sincosf(rope_angle(p, i, pos), &s, &c);
  return rope_rotate(v, i, p.rotary_dim / 2, c, s);
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

// v as a cache of `dtype` holds it (0 f32, 1 bf16, 2 f16: kv_put's rounding), as f32.
__device__ __forceinline__ float kv_round(uint dtype, float v) {
  return dtype == 0 ? v : dtype == 1 ? bf16_float(float_bf16(v)) : f16_float(float_f16(v));
}

// ---------------------------------------------------------------- decode (one token, split keys)
// attention (decode): out = softmax(q K^T * scale, causal) V * sigmoid(gate) for one query token,
// flash-decoding in ONE launch (the split pass and the combine; prefill, T > 1, runs
// attention_prefill below). q / gate from qg [T, H, 2*hd] (q then gate per head); token t sees
// cache rows 0 .. pos0 + t (pos0 = step[0]).
// Split pass: one block per (KV head, token, split) with G = H / Hkv query heads sharing that KV
// head, W G warps (W = 2 where 2 G warps fit 512 threads, the host's ATTENTION_WARPS). Scoring,
// a warp serves HP heads (HP = 2 where G <= 15 is even and hd = 256, the model's decode: each K / V value
// read and widened once for both; else 1): warp w the heads HP (w % (G / HP)) + j, in part
// w / (G / HP) of parts = W HP. Split z of `splits` covers rows [z * rows, (z + 1) * rows) of the causal
// range, rows = ceil(len / splits) rounded up to ATT_SUB, so the grid does not depend on the
// position (a decode graph stays valid). The split's rows go through shared memory in stages of
// 32 rows (bf16 caches, staged as their bits: half the shared-memory bytes the warps read) or
// 16 rows (f32 and f16 caches, widened to f32); the 16-byte loads of the NEXT stage are issued
// into registers (AttAhead) before this stage is scored, so their latency hides behind the
// arithmetic instead of following a barrier. A warp scores ATT_SUB rows together (independent
// lane partials, one reduce-scatter for its HP ATT_SUB sums), then rescales once: online softmax
// in f32; the parts take every parts-th group of ATT_SUB rows of a stage and merge their (max,
// sum, o) through shared memory at the end (at depth 4K a block's 2 warps a scheduler were the
// issue limit). Combining, a warp serves one head, w % G. Lanes hold
// ATT_HD_MAX / 32 dims (att_dim: pairs 64 i + 2 lane + {0, 1} when hd % 64 == 0, read as one
// 4- or 8-byte shared load, else 32 i + lane).
// Combine (last-block-done, the pattern of moe_router): each block stores its partial (running
// max, sum of exp, unnormalised o) per head into part1 [T, H, splits, 2 + hd]; the last block of
// each group of ATT_GROUP splits to finish (last_block: a device-scope fence, then atomicAdd on its counter)
// combines the group's partials into part2 [T, H, groups, 2 + hd]; the last group to finish
// combines those into out [T, H * hd] with the sigmoid gate. Two levels of ATT_GROUP instead of
// one block reading all `splits` partials of its G heads (half a megabyte at 64 splits: one SM's
// share of L2 bandwidth). The last blocks set their counters back to 0 (a replayed graph finds
// them 0; zero as allocated). An empty split (rows past len) stores max -FLT_MAX, sum 0: it
// weighs nothing. counts [T, Hkv, groups + 1] u32: groups level-1 counters, then the level-2 one.
// Fused qk_norm_rope_store (q_norm not null; T = 1, the host's qk_norm_rope_store_attention):
// qg holds q as the projection left it; every block norms and ropes its G heads' q (registers
// only; the RoPE's cos / sin of the new row, whose position is known before the grid wait, are
// tabled in shared memory then); the block whose split holds the new row len - 1 norms and ropes
// k [Hkv, hd] into it and copies v [Hkv, hd] (AttRope; the other blocks never read that row).
// Arguments: AttentionParams p (pos0 unused), uint splits, step, KvDesc k, KvDesc v, qg, counts,
// part (part1 then part2), out, RopeParams rp (pos0 unused), q_norm, k_norm, k, v (all null when
// not fused). Grid (Hkv, T, splits), W * G * 32 threads (W * G * hd <= 4096 when fused: the q
// scratch; W HP <= 4: the parts' merge uses the K and V stages as two regions of G (hd + 2) floats).
#define KV_BATCH 4
#define ATT_TILE 16
// Rows a warp scores together (att_tile; a loop over them, not unrolled, covers a stage): the
// kernel's hot loop must fit the instruction cache (16 rows unrolled made the decode instantiation
// ~8.5 k SASS instructions).
#define ATT_SUB 4
#define ATT_HD_MAX ATTENTION_HEAD_DIM_MAX
#define ATT_STAGE_BYTES (ATT_TILE * ATT_HD_MAX * 4)  // a tensor's stage: 16 f32 or 32 bf16 rows of 256
#define ATT_GROUP 8                                   // splits (then groups) a last block combines

// Lane `lane`'s dim of its slot i (i < hd / 32): pairs 64 (i / 2) + 2 lane + i % 2 when P = 2.
template <int P>
__device__ __forceinline__ uint att_dim(uint i, uint lane) {
  return P == 2 ? 32 * (i & ~1u) + 2 * lane + (i & 1u) : 32 * i + lane;
}

// The K and V pieces (16 bytes of a cache row each) a thread loads ahead for one stage: piece
// idx = j blockDim + tid is row idx / per_row, bytes 16 (idx % per_row) of the head's columns.
template <uint B>
struct AttAhead {
  static constexpr uint N = B;
  uint4 k[B], v[B];
};

// Issue the loads of the first A::N * blockDim pieces of cache rows base .. base + n.
template <class A>
__device__ __forceinline__ void att_fetch(const KvDesc kd, const KvDesc vd, uint base, uint n, uint col0, uint hd,
                                          A& a) {
  const uint epv = kd.dtype == 0 ? 4 : 8, per_row = hd / epv, total = n * per_row;
#pragma unroll
  for (uint j = 0; j < A::N; ++j) {
    const uint idx = j * blockDim.x + threadIdx.x;
    if (idx < total) kv_load16(kd, vd, base + idx / per_row, col0 + (idx % per_row) * epv, a.k[j], a.v[j]);
  }
}

// Piece idx (k, v) into the staged rows ks / vs [n][hd]: BF as the cache's bf16 bits, else f32.
template <bool BF>
__device__ __forceinline__ void att_put(uint dtype, uint idx, uint per_row, uint epv, uint hd, const uint4 k,
                                        const uint4 v, uint4* ks, uint4* vs) {
  const uint o = (idx / per_row) * hd + (idx % per_row) * epv;  // element of the staged rows
  if constexpr (BF) {
    ks[o / 8] = k;
    vs[o / 8] = v;
  } else {
    kv_widen(dtype, k, reinterpret_cast<float*>(ks) + o);
    kv_widen(dtype, v, reinterpret_cast<float*>(vs) + o);
  }
}

// Stage cache rows base .. base + n: the pieces loaded ahead in `a`, then any past them (blocks
// of fewer than 8 warps, f32 caches) loaded here; row `skip` left out (the new row of a fused
// decode step: its caller stages it from registers, the loads of it are stale).
template <bool BF, class A>
__device__ __forceinline__ void att_stage(const KvDesc kd, const KvDesc vd, uint base, uint n, uint col0, uint hd,
                                          uint skip, const A& a, uint4* ks, uint4* vs) {
  const uint epv = kd.dtype == 0 ? 4 : 8, per_row = hd / epv, total = n * per_row;
#pragma unroll
  for (uint j = 0; j < A::N; ++j) {
    const uint idx = j * blockDim.x + threadIdx.x;
    if (idx < total && base + idx / per_row != skip) att_put<BF>(kd.dtype, idx, per_row, epv, hd, a.k[j], a.v[j], ks, vs);
  }
  for (uint idx = A::N * blockDim.x + threadIdx.x; idx < total; idx += blockDim.x) {
    if (base + idx / per_row == skip) continue;
    uint4 k, v;
    kv_load16(kd, vd, base + idx / per_row, col0 + (idx % per_row) * epv, k, v);
    att_put<BF>(kd.dtype, idx, per_row, epv, hd, k, v, ks, vs);
  }
}

// The P staged values of this lane's slot i (i % P == 0) in staged row `row` of s, as f32: one
// P-element load at unit row (hd / P) + lane + (32 / P) i (att_dim / P). The row's pointer first,
// then the slot's constant offset: the compiler folds the offset into the load; from an element
// index divided by P it spent three integer instructions a load (SASS, 2026-12-07: a fifth of a
// 4-row sub-tile's ~485), and a 32-bit unit index (which may wrap) still two.
template <int P, bool BF>
__device__ __forceinline__ void att_at(const uint4* s, uint row, uint hd, uint i, uint lane, float* v) {
  const uint at = row * (hd / P) + lane;  // the same for every slot of a row
  if constexpr (BF && P == 2) {
    const uint w = (reinterpret_cast<const uint*>(s) + at)[16 * i];
    v[0] = bf16_float((ushort)(w & 0xffffu));
    v[1] = bf16_float((ushort)(w >> 16));
  } else if constexpr (BF) {
    v[0] = bf16_float((reinterpret_cast<const ushort*>(s) + at)[32 * i]);
  } else if constexpr (P == 2) {
    const float2 f = (reinterpret_cast<const float2*>(s) + at)[16 * i];
    v[0] = f.x;
    v[1] = f.y;
  } else {
    v[0] = (reinterpret_cast<const float*>(s) + at)[32 * i];
  }
}

// The warp's N partial sums v[0 .. N) (N a power of two <= 32) summed over its lanes, every lane
// getting every sum: a reduce-scatter (each xor step keeps half the values a lane carries: one
// shuffle a kept value instead of one a value a step), then one shuffle a sum to broadcast it.
// 4 sums: 10 shuffles instead of 20; 8 sums: 17 instead of 40.
template <uint N>
__device__ __forceinline__ void warp_sum_all(float* v, uint lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N a power of two <= 32");
  uint d = 16;
#pragma unroll
  for (uint m = N / 2; m >= 1; m /= 2, d /= 2) {  // lanes with bit d keep the upper m values
    const bool up = (lane & d) != 0;
#pragma unroll
    for (uint i = 0; i < m; ++i) {
      const float send = up ? v[i] : v[i + m], keep = up ? v[i + m] : v[i];
      v[i] = keep + __shfl_xor_sync(FULL_MASK, send, d);
    }
  }
  // Lane L now holds sum number L / (32 / N) over the N lanes that differ from it in the high
  // bits; the 32 / N lanes that differ from it in the low bits hold parts of the same sum: add them.
#pragma unroll
  for (; d > 0; d /= 2) v[0] += __shfl_xor_sync(FULL_MASK, v[0], d);
  const float mine = v[0];
#pragma unroll
  for (uint k = 0; k < N; ++k) v[k] = __shfl_sync(FULL_MASK, mine, k * (32 / N));
}

// Staged rows r0 .. r0 + n (n <= R) into this warp's online softmax (mx, l, o) of its HP heads
// (q[j], o[j]: head j's dims of this lane): each K / V value is read from shared memory and
// widened once for the HP heads.
template <int P, bool BF, uint R, uint HP>
__device__ __forceinline__ void att_tile(const uint4* ks, const uint4* vs, uint r0, uint n, uint hd, uint lane,
                                         const float (*q)[ATT_HD_MAX / 32], float (*o)[ATT_HD_MAX / 32], float* mx,
                                         float* l) {
  constexpr uint NS = ATT_HD_MAX / 32;
  const uint nd = hd / 32;
  // Scores of the tile's rows, sc[j * R + r] (rows past n hold stale values: never used).
  float sc[HP * R];
#pragma unroll
  for (uint r = 0; r < R; ++r) {
#pragma unroll
    for (uint j = 0; j < HP; ++j) sc[j * R + r] = 0.0f;
#pragma unroll
    for (uint i = 0; i < NS; i += P) {
      if (i < nd) {
        float k[P];
        att_at<P, BF>(ks, r0 + r, hd, i, lane, k);
#pragma unroll
        for (uint j = 0; j < HP; ++j)
#pragma unroll
          for (int e = 0; e < P; ++e) sc[j * R + r] += q[j][i + e] * k[e];
      }
    }
  }
  warp_sum_all<HP * R>(sc, lane);
  float m_new[HP];
#pragma unroll
  for (uint j = 0; j < HP; ++j) {
    m_new[j] = mx[j];
#pragma unroll
    for (uint r = 0; r < R; ++r)
      if (r < n) m_new[j] = fmaxf(m_new[j], sc[j * R + r]);
    const float corr = expf(mx[j] - m_new[j]);
    l[j] *= corr;
#pragma unroll
    for (uint i = 0; i < NS; ++i) o[j][i] *= corr;
    mx[j] = m_new[j];
  }
#pragma unroll
  for (uint r = 0; r < R; ++r) {
    if (r >= n) break;
    float e[HP];
#pragma unroll
    for (uint j = 0; j < HP; ++j) {
      e[j] = expf(sc[j * R + r] - m_new[j]);
      l[j] += e[j];
    }
#pragma unroll
    for (uint i = 0; i < NS; i += P) {
      if (i < nd) {
        float v[P];
        att_at<P, BF>(vs, r0 + r, hd, i, lane, v);
#pragma unroll
        for (uint j = 0; j < HP; ++j)
#pragma unroll
          for (int c = 0; c < P; ++c) o[j][i + c] += e[j] * v[c];
      }
    }
  }
}

// A head's partial (max, sum, this lane's dims of o) into dst [2 + hd].
template <int P>
__device__ __forceinline__ void att_put_partial(float* dst, uint hd, uint lane, float mx, float l, const float* o) {
  if (lane == 0) {
    dst[0] = mx;
    dst[1] = l;
  }
#pragma unroll
  for (uint i = 0; i < ATT_HD_MAX / 32; ++i)
    if (i < hd / 32) dst[2 + att_dim<P>(i, lane)] = o[i];
}

// The n <= 32 partials src, src + (2 + hd), ... of one head combined by its warp into (mx, l, o).
// Read through L2 (load_l2: other blocks of this launch wrote them; never a stale L1 line). Lane z
// loads partial z's max and sum, so the maximum is one round trip and a warp reduction, and no
// load of the o rows depends on it (the weights come by shuffle): the o rows of a pass are in
// flight with the max / sum loads.
template <int P>
__device__ __forceinline__ void att_combine(const float* src, uint n, uint hd, uint lane, float& mx, float& l,
                                            float* o) {
  constexpr uint NS = ATT_HD_MAX / 32;
  const uint nd = hd / 32;
  const float mz = lane < n ? load_l2(src + (size_t)lane * (hd + 2)) : NEG_BIG;
  const float sz = lane < n ? load_l2(src + (size_t)lane * (hd + 2) + 1) : 0.0f;
  float acc[NS];
#pragma unroll
  for (uint i = 0; i < NS; ++i) acc[i] = 0.0f;
  mx = warp_max(mz);
  const float w = lane < n ? expf(mz - mx) : 0.0f;  // an empty partial: exp(-FLT_MAX - m) = 0, or 1 times l = 0
  l = warp_sum(sz * w);
#pragma unroll 4
  for (uint z = 0; z < n; ++z) {
    const float* s = src + (size_t)z * (hd + 2) + 2;
    const float wz = __shfl_sync(FULL_MASK, w, z);
#pragma unroll
    for (uint i = 0; i < NS; ++i)
      if (i < nd) acc[i] += load_l2(s + att_dim<P>(i, lane)) * wz;
  }
#pragma unroll
  for (uint i = 0; i < NS; ++i) o[i] = acc[i];
}

// The inputs of qk_norm_rope_store when decode attention does its work (q_norm null: not fused).
struct AttRope {
  RopeParams p;
  const float* q_norm;
  const float* k_norm;
  const float* k;  // [Hkv, hd] the new row's k before norm + RoPE
  const float* v;  // [Hkv, hd]
  float* cs;       // shared [2 hd]: cos, sin of the new row's angle for each rotated dim (att_rope_table)
};

// The block's table of cos, sin at row `pos` for the rotated dims (rope_angle), before the
// grid wait: the position is known then, so no powf / sincosf is left between q's arrival and its
// first score.
__device__ __forceinline__ void att_rope_table(const RopeParams rp, float pos, uint hd, float* cs) {
  const uint rot = min(rp.rotary_dim, hd);
  for (uint d = threadIdx.x; d < rot; d += blockDim.x) sincosf(rope_angle(rp, d, pos), &cs[2 * d + 1], &cs[2 * d]);
}

// One warp's head x [hd] (this lane's dims in x[], P as att_dim) normed with weight w and roped
// into y[] with the block's table cs (qk_norm_rope_store's math: stage_normed, rope_rotate); xs: the
// warp's hd floats of shared scratch (RoPE pairs dims across lanes).
template <int P>
__device__ __forceinline__ void att_norm_rope(const RopeParams rp, const float* x, const float* __restrict__ w,
                                              const float* cs, uint hd, uint lane, float* xs, float* y) {
  constexpr uint NS = ATT_HD_MAX / 32;
  const uint nd = hd / 32;
  float ss = 0.0f;
#pragma unroll
  for (uint i = 0; i < NS; ++i)
    if (i < nd) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)hd + rp.eps);
#pragma unroll
  for (uint i = 0; i < NS; ++i)
    if (i < nd) xs[att_dim<P>(i, lane)] = x[i] * inv * w[att_dim<P>(i, lane)];
  __syncwarp();
  const uint rot = rp.rotary_dim, half = rot / 2;
#pragma unroll
  for (uint i = 0; i < NS; ++i) {
    const uint d = att_dim<P>(i, lane);
    y[i] = i >= nd ? 0.0f : d >= rot ? xs[d] : rope_rotate(xs, d, half, cs[2 * d], cs[2 * d + 1]);
  }
  __syncwarp();  // xs may be reused
}

// HD: the head dimension when known at compile time (0: p.head_dim). The model's 256 gets its own
// instantiation: every `i < hd / 32` test of the inlined helpers then folds away, and with it a
// branch and reconvergence point (BSSY / BSYNC) per unrolled slot; the generic kernel was 79,552
// SASS instructions, 32 % of its stall samples instruction-cache misses on the H200 (Nsight Compute,
// 2026-12-02 10:00).
// HP: query heads a warp scores (1, or 2 where G is even and G (hd + 2) floats fit a stage: the
// model's decode). The scores are
// issue-bound (2026-12-07: ~300 instructions a warp for 4 rows of one head, 4 warps a scheduler);
// two heads a warp read and widen each K / V value once for both and sum 8 scores in one
// reduce-scatter, ~25 % fewer instructions a row and head.
template <int P, bool BF, uint HD, uint HP>
__device__ __forceinline__ void attention_decode(const AttentionParams p, uint splits, uint len, const KvDesc kd,
                                                 const KvDesc vd, const float* __restrict__ qg, uint* counts,
                                                 float* part, float* __restrict__ out, const AttRope& rope,
                                                 uint4* ks, uint4* vs, float* nk, float* nv, uint* flag) {
  constexpr uint NS = ATT_HD_MAX / 32, SR = BF ? 2 * ATT_TILE : ATT_TILE;  // rows a stage
  const uint kvh = blockIdx.x, t = blockIdx.y, split = blockIdx.z, T = gridDim.y;
  const uint warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = p.heads / p.kv_heads;
  // Scoring: warp w serves heads HP (w % (G / HP)) + j, j < HP, and scores the sub-tiles
  // w / (G / HP), + parts, ... of each stage (parts = warps / (G / HP): 1, 2 or 4).
  const uint slots = group / HP, hw = warp % slots, part_of = warp / slots, parts = blockDim.x / (32 * slots);
  const uint hd = HD != 0 ? HD : p.head_dim, nd = hd / 32;
  const uint per = (len + splits - 1) / splits;
  const uint rows = (per + ATT_SUB - 1) / ATT_SUB * ATT_SUB;
  const uint s0 = min(len, split * rows), s1 = min(len, s0 + rows), col0 = kvh * hd;
  const uint h0 = kvh * group + hw * HP;  // the warp's first head
  const size_t q0 = (size_t)t * p.heads + h0;  // (token, head)
  // Fused (one token): the cache rows before the new one were written by earlier steps (earlier
  // graph launches), so the first stage's loads are issued before waiting for the kernel before
  // this one (programmatic dependent launch), through L2 (kv_load16: not a stale line of L1); the
  // new row, which this launch writes, is skipped by the staging. Not fused, the rows of this step
  // were written by the kernel before: after.
  // (grid_dep_wait twice: the second returns at once; one copy of att_fetch's code.)
  AttAhead<HP == 2 ? 2 : KV_BATCH> a;  // two heads a warp: registers for 2 pieces (a stage at 512 threads)
  if (!rope.q_norm) grid_dep_wait();
  if (s0 < s1) att_fetch(kd, vd, s0, min(SR, s1 - s0), col0, hd, a);
  if (rope.q_norm) {
    att_rope_table(rope.p, (float)(len - 1), hd, rope.cs);
    __syncthreads();
  }
  grid_dep_wait();
  float q[HP][NS], o[HP][NS], mx[HP], l[HP];
#pragma unroll
  for (uint j = 0; j < HP; ++j) {
    const float* qh = qg + (q0 + j) * 2 * hd;
#pragma unroll
    for (uint i = 0; i < NS; ++i) {
      q[j][i] = i < nd ? qh[att_dim<P>(i, lane)] : 0.0f;
      o[j][i] = 0.0f;
    }
    mx[j] = NEG_BIG;
    l[j] = 0.0f;
  }
  // Fused (one token): q normed and roped by every block for its G heads, in registers only (the
  // other splits read qg too: it is not written back). The new row len - 1 is read by one block
  // only, the split that holds it: that block norms and ropes k into the cache row and copies v
  // (kv_put: visible to the kernels after this one), and stages the row from nk / nv, as the cache
  // rounds it, instead of loading it (its loads, issued above, may precede the stores: skipped).
  const uint row = len - 1, skip = rope.q_norm && s0 <= row && row < s1 ? row : 0xffffffffu;
  if (rope.q_norm) {
    float* xs = reinterpret_cast<float*>(ks) + warp * hd;  // scratch until the first stage
    const bool has_k = skip == row && warp == 0;
    float kx[NS];
#pragma unroll
    for (uint i = 0; i < NS; ++i) kx[i] = has_k && i < nd ? rope.k[col0 + att_dim<P>(i, lane)] : 0.0f;
    // The warp's q heads, then (the new row's block, warp 0) k through one copy of the norm + RoPE
    // code: the kernel runs once per block, so its code size is fetched, not amortized (Nsight
    // Compute, 19:12: 40 % of the stall samples instruction-cache misses at depth ~516). Pass
    // `pass` < HP is q head `pass`, HP is k (selected, not indexed: q stays in registers).
#pragma unroll 1
    for (uint pass = 0; pass < HP + (has_k ? 1u : 0u); ++pass) {
      float x[NS], y[NS];
#pragma unroll
      for (uint i = 0; i < NS; ++i) {
        x[i] = kx[i];
#pragma unroll
        for (uint j = 0; j < HP; ++j) x[i] = pass == j ? q[j][i] : x[i];
      }
      att_norm_rope<P>(rope.p, x, pass == HP ? rope.k_norm : rope.q_norm, rope.cs, hd, lane, xs, y);
#pragma unroll
      for (uint i = 0; i < NS; ++i) {
        kx[i] = pass == HP ? y[i] : kx[i];
#pragma unroll
        for (uint j = 0; j < HP; ++j) q[j][i] = pass == j ? y[i] : q[j][i];
      }
    }
    if (has_k) {
      if constexpr (BF) {  // the cache's dtype is bf16: the row's stores without kv_put's dtype cases
        const size_t at = (size_t)(row & ((1u << kd.seg_shift) - 1)) * kd.width + col0;
        ushort* kr = reinterpret_cast<ushort*>(reinterpret_cast<const u64*>(kd.seg)[row >> kd.seg_shift]) + at;
        ushort* vr = reinterpret_cast<ushort*>(reinterpret_cast<const u64*>(vd.seg)[row >> vd.seg_shift]) + at;
#pragma unroll
        for (uint i = 0; i < NS; ++i) {
          if (i < nd) {
            const uint d = att_dim<P>(i, lane);
            const ushort kb = float_bf16(kx[i]), vb = float_bf16(rope.v[col0 + d]);
            kr[d] = kb;
            vr[d] = vb;
            nk[d] = bf16_float(kb);
            nv[d] = bf16_float(vb);
          }
        }
      } else {
#pragma unroll
        for (uint i = 0; i < NS; ++i) {
          if (i < nd) {
            const uint d = att_dim<P>(i, lane);
            const float v = rope.v[col0 + d];
            kv_put(kd, row, col0 + d, kx[i]);
            kv_put(vd, row, col0 + d, v);
            nk[d] = kv_round(kd.dtype, kx[i]);
            nv[d] = kv_round(vd.dtype, v);
          }
        }
      }
    }
    __syncthreads();  // ks is staged next; nk / nv are read by every thread
  }
#pragma unroll
  for (uint j = 0; j < HP; ++j)
#pragma unroll
    for (uint i = 0; i < NS; ++i) q[j][i] *= p.scale;
  for (uint base = s0; base < s1; base += SR) {
    const uint n = min(SR, s1 - base);
    att_stage<BF>(kd, vd, base, n, col0, hd, skip, a, ks, vs);
    if (skip - base < n) {  // the new row: from nk / nv, in the staged form
      const uint r = skip - base;
      for (uint d = threadIdx.x; d < hd; d += blockDim.x) {
        if constexpr (BF) {
          reinterpret_cast<ushort*>(ks)[r * hd + d] = float_bf16(nk[d]);
          reinterpret_cast<ushort*>(vs)[r * hd + d] = float_bf16(nv[d]);
        } else {
          reinterpret_cast<float*>(ks)[r * hd + d] = nk[d];
          reinterpret_cast<float*>(vs)[r * hd + d] = nv[d];
        }
      }
    }
    __syncthreads();
    if (base + SR < s1) att_fetch(kd, vd, base + SR, min(SR, s1 - base - SR), col0, hd, a);  // during the scores
#pragma unroll 1
    for (uint r0 = part_of * ATT_SUB; r0 < n; r0 += parts * ATT_SUB)
      att_tile<P, BF, ATT_SUB, HP>(ks, vs, r0, min((uint)ATT_SUB, n - r0), hd, lane, q, o, mx, l);
    __syncthreads();  // the stage is refilled next
  }
  // Combining, one head a warp: warp w serves head w % G of the group (the warps past G repeat the work
  // and store nothing). Its gate, loaded now (the last block to combine needs it at the very end).
  const uint hc = kvh * group + warp % group;
  const size_t qc = (size_t)t * p.heads + hc;
  float gv[NS];
#pragma unroll
  for (uint i = 0; i < NS; ++i) gv[i] = i < nd ? qg[qc * 2 * hd + hd + 32 * i + lane] : 0.0f;
  // The parts' (mx, l, o) into part 0's, a tree through the free K and V stages: at each step the
  // upper half of the parts left store into region (part - span) (the K stage, then the V stage;
  // G (hd + 2) floats each), and the lower half merge them.
#pragma unroll 1
  for (uint span = parts / 2; span >= 1; span /= 2) {
    const bool store = part_of >= span && part_of < 2 * span, merge = part_of < span;
    float* region = reinterpret_cast<float*>((store ? part_of - span : part_of) == 0 ? ks : vs);
#pragma unroll
    for (uint j = 0; j < HP; ++j)
      if (store) att_put_partial<P>(region + (hw * HP + j) * (hd + 2), hd, lane, mx[j], l[j], o[j]);
    __syncthreads();
#pragma unroll
    for (uint j = 0; j < HP; ++j) {
      if (merge) {
        const float* other = region + (hw * HP + j) * (hd + 2);
        const float m = fmaxf(mx[j], other[0]), w0 = expf(mx[j] - m), w1 = expf(other[0] - m);
        l[j] = l[j] * w0 + other[1] * w1;
#pragma unroll
        for (uint i = 0; i < NS; ++i)
          if (i < nd) o[j][i] = o[j][i] * w0 + other[2 + att_dim<P>(i, lane)] * w1;
        mx[j] = m;
      }
    }
    __syncthreads();  // the stages are scratch again below
  }
  // Level 1: the partial of this split (part 0's warps, HP heads each); the group's last block
  // combines the group's. Level 2: the group's partial (one head a warp); the last group's block
  // combines them all. One copy of the code for both levels (a loop that is not unrolled: see the
  // norm + RoPE above).
  const uint groups = (splits + ATT_GROUP - 1) / ATT_GROUP, g = split / ATT_GROUP;
  const uint in_group = min((uint)ATT_GROUP, splits - g * ATT_GROUP);
  float* part1 = part + (size_t)t * p.heads * splits * (hd + 2);
  float* part2 = part + (size_t)T * p.heads * splits * (hd + 2) + qc * groups * (hd + 2);
  uint* cnt = counts + ((size_t)t * p.kv_heads + kvh) * (groups + 1);
  float cmx = NEG_BIG, cl = 0.0f, co[NS] = {};
#pragma unroll 1
  for (uint level = 0; level < (groups > 1 ? 2u : 1u); ++level) {
    if (level == 0) {
#pragma unroll
      for (uint j = 0; j < HP; ++j)
        if (part_of == 0)
          att_put_partial<P>(part1 + ((size_t)(h0 + j) * splits + split) * (hd + 2), hd, lane, mx[j], l[j], o[j]);
    } else if (warp < group) {
      att_put_partial<P>(part2 + (size_t)g * (hd + 2), hd, lane, cmx, cl, co);
    }
    if (!last_block(cnt + (level == 0 ? g : groups), level == 0 ? in_group : groups, flag)) return;  // whole block
    const float* src = level == 0 ? part1 + ((size_t)hc * splits + g * ATT_GROUP) * (hd + 2) : part2;
    att_combine<P>(src, level == 0 ? in_group : groups, hd, lane, cmx, cl, co);
  }
  // out = o / l * sigmoid(gate), through the warp's hd floats of the K stage (free since the last
  // barrier): o in att_dim order in, out in plain order (dim 32 i + lane, as gv) out.
  float* os = reinterpret_cast<float*>(ks) + warp * hd;
  const float inv_l = 1.0f / cl;
#pragma unroll
  for (uint i = 0; i < NS; ++i)
    if (i < nd) os[att_dim<P>(i, lane)] = co[i] * inv_l;
  __syncwarp();
#pragma unroll
  for (uint i = 0; i < NS; ++i)
    if (i < nd && warp < group) out[qc * hd + 32 * i + lane] = os[32 * i + lane] * sigmoid(gv[i]);
}

extern "C" __global__ void __launch_bounds__(512, 1) attention(
    const AttentionParams p, const uint splits, const uint* __restrict__ step, const KvDesc kd, const KvDesc vd,
    const float* __restrict__ qg, uint* counts, float* part, float* __restrict__ out, const RopeParams rp,
    const float* q_norm, const float* k_norm, const float* k, const float* v) {
  grid_dep_launch();  // grid_dep_wait(): attention_decode, after its first cache loads
  __shared__ uint4 ks[ATT_STAGE_BYTES / 16];
  __shared__ uint4 vs[ATT_STAGE_BYTES / 16];
  __shared__ float nk[ATT_HD_MAX];
  __shared__ float nv[ATT_HD_MAX];
  __shared__ uint flag[1];
  __shared__ float cs[2 * ATT_HD_MAX];
  const AttRope rope{rp, q_norm, k_norm, k, v, cs};
  const uint len = load_l2(step) + blockIdx.y + 1;  // before the wait (attention_decode): through L2
  // Two heads a warp where the group is even and the parts' merge regions (G (hd + 2) floats) fit a stage.
  const uint group = p.heads / p.kv_heads;
  const bool pairs = p.head_dim % 64 == 0, full = p.head_dim == ATT_HD_MAX;
  const bool two = group % 2 == 0 && group * (ATT_HD_MAX + 2) <= ATT_STAGE_BYTES / 4;
  if (kd.dtype == 1) {
    if (full && two)
      attention_decode<2, true, ATT_HD_MAX, 2>(p, splits, len, kd, vd, qg, counts, part, out, rope, ks, vs, nk, nv, flag);
    else if (full)
      attention_decode<2, true, ATT_HD_MAX, 1>(p, splits, len, kd, vd, qg, counts, part, out, rope, ks, vs, nk, nv, flag);
    else if (pairs)
      attention_decode<2, true, 0, 1>(p, splits, len, kd, vd, qg, counts, part, out, rope, ks, vs, nk, nv, flag);
    else
      attention_decode<1, true, 0, 1>(p, splits, len, kd, vd, qg, counts, part, out, rope, ks, vs, nk, nv, flag);
  } else {
    if (full && two)
      attention_decode<2, false, ATT_HD_MAX, 2>(p, splits, len, kd, vd, qg, counts, part, out, rope, ks, vs, nk, nv, flag);
    else if (full)
      attention_decode<2, false, ATT_HD_MAX, 1>(p, splits, len, kd, vd, qg, counts, part, out, rope, ks, vs, nk, nv, flag);
    else if (pairs)
      attention_decode<2, false, 0, 1>(p, splits, len, kd, vd, qg, counts, part, out, rope, ks, vs, nk, nv, flag);
    else
      attention_decode<1, false, 0, 1>(p, splits, len, kd, vd, qg, counts, part, out, rope, ks, vs, nk, nv, flag);
  }
}

// attention_prefill: out = softmax(q K^T * scale, causal) V * sigmoid(gate) for the T > 1 query
// tokens of a prefill chunk, flash-attention style on the tensor cores.
// Layouts: qg [T, H, 2*hd] f32 (q then gate per head); out [T, H * hd] f32; K / V caches through
// KvDesc (row width Hkv * hd, dtype f32 / bf16 / f16). Token t is at position pos0 + t (pos0 =
// step[0]: a chunk may start anywhere in the cache) and sees cache rows 0 .. pos0 + t.
// Tiles: a block owns ATTENTION_QUERY_ROWS (64) query rows of one KV head: row r is token
// t0 + r / G of query head kvh * G + r % G (G = H / Hkv, so the G heads sharing K/V sit in one
// tile and each K/V row is staged once for all of them); TT = 64 / G tokens per block, the last
// block partial. Blocks run the latest tokens first (the longest causal ranges start earliest).
// Keys go in tiles of FA_KEYS = 16 rows: the block stages K [16][hd] and V transposed [hd][16] as
// bf16 in shared memory (FA_LD / FA_VLD padding: the fragment reads of a warp hit 32 banks).
// Threads: 128 = 4 warps, warp w owns tile rows 16 w .. 16 w + 15 (an m16 slice): S = Q K^T is
// 2 m16n8 accumulators (16 keys), O [16][hd] is hd / 8 m16n8 accumulators in registers, both
// mma.sync m16n8k16 with f32 accumulation; P goes from the S accumulators straight into the A
// fragments of P V (same lane layout). Online softmax in f32: running max and sum per row (a row
// lives on the 4 lanes of a quad), O rescaled when the max moves.
// Accuracy: f32-grade, not bf16-grade. q and p are split as hi + lo bf16 pairs (x = hi + lo + 2^-17
// x) and multiplied as hi·k + lo·k; a bf16 cache is exact in bf16, an f16 cache exactly hi + lo,
// an f32 cache hi + lo to 2^-17 (the k_lo / v_lo products added when the dtype is not bf16). So
// each product is good to ~2^-16 relative: 2 mma per product (3 off bf16 caches) instead of 1.
// Arguments: AttentionParams p (pos0 unused), step, KvDesc k, KvDesc v, qg, out.
// Grid (ceil(T / TT), Hkv), 128 threads.
#define FA_ROWS ATTENTION_QUERY_ROWS
#define FA_KEYS 16
#define FA_LD (ATT_HD_MAX + 8)
#define FA_VLD (FA_KEYS + 8)

// x = hi + lo for two values, as bf16x2 registers (lo exact: hi keeps x's top 8 significant bits).
__device__ __forceinline__ void split_bf16x2(float a, float b, uint& hi, uint& lo) {
  hi = pack_bf16x2(a, b);
  lo = pack_bf16x2(a - bf16_float((ushort)(hi & 0xffffu)), b - bf16_float((ushort)(hi >> 16)));
}

// Stage cache rows base .. base + FA_KEYS (rows from n on as zeros) of columns col0 .. col0 + hd of
// K into kh / kl [key][FA_LD] and of V into vh / vl [dim][FA_VLD] (transposed) as bf16 hi / lo
// (the lo halves only when `lo`, i.e. not bf16, whose bits are copied as they are): 16-byte loads, KV_BATCH per tensor and thread issued before any
// is converted. Item idx is key idx % FA_KEYS, 16-byte piece idx / FA_KEYS of the row: the K stores
// of 8 neighbouring lanes (8 keys, rows FA_LD apart) cover the 32 banks once, and a warp's
// transposed V stores (16 keys of two pieces) touch each bank at most twice.
__device__ __forceinline__ void fa_stage(const KvDesc kd, const KvDesc vd, uint base, uint n, uint col0, uint hd,
                                         bool lo, ushort* kh, ushort* kl, ushort* vh, ushort* vl) {
  const uint epv = kd.dtype == 0 ? 4 : 8, total = FA_KEYS * (hd / epv);
  for (uint b0 = 0; b0 < total; b0 += KV_BATCH * blockDim.x) {
    uint4 kv[KV_BATCH], vv[KV_BATCH];
#pragma unroll
    for (int j = 0; j < KV_BATCH; ++j) {
      const uint idx = b0 + j * blockDim.x + threadIdx.x, key = idx % FA_KEYS;
      kv[j] = vv[j] = make_uint4(0, 0, 0, 0);
      if (idx < total && key < n) kv_load16(kd, vd, base + key, col0 + idx / FA_KEYS * epv, kv[j], vv[j]);
    }
#pragma unroll
    for (int j = 0; j < KV_BATCH; ++j) {
      const uint idx = b0 + j * blockDim.x + threadIdx.x;
      if (idx >= total) continue;
      const uint key = idx % FA_KEYS, c = idx / FA_KEYS * epv;
      if (!lo) {  // bf16: the cache bits are the hi halves
        *reinterpret_cast<uint4*>(&kh[key * FA_LD + c]) = kv[j];
        const uint w[4] = {vv[j].x, vv[j].y, vv[j].z, vv[j].w};
#pragma unroll
        for (uint e = 0; e < 8; ++e) vh[(c + e) * FA_VLD + key] = (ushort)(w[e / 2] >> (16 * (e % 2)));
        continue;
      }
      float k[8], v[8];
      uint h[4], l[4];
      kv_widen(kd.dtype, kv[j], k);
      kv_widen(vd.dtype, vv[j], v);
#pragma unroll
      for (uint e = 0; e < 4; ++e)
        if (2 * e < epv) split_bf16x2(k[2 * e], k[2 * e + 1], h[e], l[e]);
      if (epv == 8) {
        *reinterpret_cast<uint4*>(&kh[key * FA_LD + c]) = make_uint4(h[0], h[1], h[2], h[3]);
        if (lo) *reinterpret_cast<uint4*>(&kl[key * FA_LD + c]) = make_uint4(l[0], l[1], l[2], l[3]);
      } else {
        *reinterpret_cast<uint2*>(&kh[key * FA_LD + c]) = make_uint2(h[0], h[1]);
        if (lo) *reinterpret_cast<uint2*>(&kl[key * FA_LD + c]) = make_uint2(l[0], l[1]);
      }
#pragma unroll
      for (uint e = 0; e < 8; ++e) {
        if (e >= epv) break;
        const ushort vhi = float_bf16(v[e]);
        vh[(c + e) * FA_VLD + key] = vhi;
        if (lo) vl[(c + e) * FA_VLD + key] = float_bf16(v[e] - bf16_float(vhi));
      }
    }
  }
}

// acc += (a_hi + a_lo) (b_hi + b_lo) without the lo·lo product: three mma m16n8k16, two when b is
// exact in bf16 (!lo). The B fragment is the bf16 pairs at b_hi / b_lo + at and + at + 8.
__device__ __forceinline__ void mma_split(float acc[4], const uint ah[4], const uint al[4], const ushort* bh,
                                          const ushort* bl, uint at, bool lo) {
  const uint b[2] = {*reinterpret_cast<const uint*>(&bh[at]), *reinterpret_cast<const uint*>(&bh[at + 8])};
  mma_bf16_16816(acc, ah, b, acc);
  mma_bf16_16816(acc, al, b, acc);
  if (lo) {
    const uint b_lo[2] = {*reinterpret_cast<const uint*>(&bl[at]), *reinterpret_cast<const uint*>(&bl[at + 8])};
    mma_bf16_16816(acc, ah, b_lo, acc);
  }
}

extern "C" __global__ void __launch_bounds__(128) attention_prefill(const AttentionParams p,
                                                                    const uint* __restrict__ step,
                                                                    const KvDesc kd, const KvDesc vd,
                                                                    const float* __restrict__ qg,
                                                                    float* __restrict__ out) {
  kernel_start();
  __shared__ __align__(16) ushort kh[FA_KEYS * FA_LD];
  __shared__ __align__(16) ushort kl[FA_KEYS * FA_LD];
  __shared__ __align__(16) ushort vh[ATT_HD_MAX * FA_VLD];
  __shared__ __align__(16) ushort vl[ATT_HD_MAX * FA_VLD];
  const uint warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  const uint hd = p.head_dim, nd8 = hd / 8, group = p.heads / p.kv_heads, tt = FA_ROWS / group;
  const uint tile = gridDim.x - 1 - blockIdx.x, kvh = blockIdx.y, t0 = tile * tt;
  const uint nt = min(tt, p.tokens - t0), pos0 = step[0];
  const bool lo = kd.dtype != 1;  // bf16 caches are exact in bf16
  // This lane's two rows (g and g + 8 of the warp's slice): token, query head, position.
  size_t qi[2];  // (token, head) index: qg row qi * 2 hd, out row qi * hd
  uint qpos[2];
  bool valid[2];
  const float* qrow[2];
  for (uint i = 0; i < 2; ++i) {
    const uint r = 16 * warp + g + 8 * i, tok = t0 + min(r / group, nt - 1);
    valid[i] = r < nt * group;
    qi[i] = (size_t)tok * p.heads + kvh * group + r % group;
    qrow[i] = qg + qi[i] * 2 * hd;
    qpos[i] = pos0 + tok;
  }
  // The keys the block needs and those this warp's rows need (a warp past the last token idles).
  const uint kend = pos0 + t0 + nt;
  const uint wrows = min(nt * group, 16 * warp + 16);
  const uint wend = wrows > 16 * warp ? pos0 + t0 + (wrows - 1) / group + 1 : 0;
  float o[ATT_HD_MAX / 8][4];
#pragma unroll
  for (uint j = 0; j < ATT_HD_MAX / 8; ++j)
    for (uint e = 0; e < 4; ++e) o[j][e] = 0.0f;
  float mx[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.0f, 0.0f};
  for (uint base = 0; base < kend; base += FA_KEYS) {
    fa_stage(kd, vd, base, min((uint)FA_KEYS, kend - base), kvh * hd, hd, lo, kh, kl, vh, vl);
    __syncthreads();
    if (base < wend) {
      // S = Q K^T over hd in k16 steps: A = q rows (hi, lo), B = K rows 8 j + g of the tile.
      float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
      for (uint kk = 0; kk < hd; kk += 16) {
        uint qh[4], ql[4];
        for (uint i = 0; i < 4; ++i) {  // a[i]: row g (+ 8 for i odd), dims kk + 2 tq (+ 8 for i >= 2)
          const float2 q = *reinterpret_cast<const float2*>(qrow[i & 1] + kk + 2 * tq + (i >= 2 ? 8 : 0));
          split_bf16x2(q.x, q.y, qh[i], ql[i]);
        }
#pragma unroll
        for (uint j = 0; j < 2; ++j) {
          mma_split(s[j], qh, ql, kh, kl, (8 * j + g) * FA_LD + kk + 2 * tq, lo);
        }
      }
      // Online softmax: s[j][e] is row g + 8 (e >> 1), key base + 8 j + 2 tq + (e & 1).
      float tmax[2] = {NEG_BIG, NEG_BIG};
      bool seen[2][4];
#pragma unroll
      for (uint j = 0; j < 2; ++j)
        for (uint e = 0; e < 4; ++e) {
          seen[j][e] = base + 8 * j + 2 * tq + (e & 1) <= qpos[e >> 1];
          s[j][e] = seen[j][e] ? s[j][e] * p.scale : NEG_BIG;
          tmax[e >> 1] = fmaxf(tmax[e >> 1], s[j][e]);
        }
      float corr[2];
      for (uint i = 0; i < 2; ++i) {
        tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(FULL_MASK, tmax[i], 1));
        tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(FULL_MASK, tmax[i], 2));
        const float m_new = fmaxf(mx[i], tmax[i]);
        corr[i] = expf(mx[i] - m_new);
        mx[i] = m_new;
        l[i] *= corr[i];
      }
#pragma unroll
      for (uint j = 0; j < 2; ++j)
        for (uint e = 0; e < 4; ++e) {
          s[j][e] = seen[j][e] ? expf(s[j][e] - mx[e >> 1]) : 0.0f;
          l[e >> 1] += s[j][e];
        }
      if (corr[0] != 1.0f || corr[1] != 1.0f) {
#pragma unroll
        for (uint j = 0; j < ATT_HD_MAX / 8; ++j)
          for (uint e = 0; e < 4; ++e) o[j][e] *= corr[e >> 1];
      }
      // O += P V: the A fragment (rows g / g + 8, keys 2 tq (+ 8)) is the S accumulators' layout.
      uint ph[4], pl[4];
      split_bf16x2(s[0][0], s[0][1], ph[0], pl[0]);
      split_bf16x2(s[0][2], s[0][3], ph[1], pl[1]);
      split_bf16x2(s[1][0], s[1][1], ph[2], pl[2]);
      split_bf16x2(s[1][2], s[1][3], ph[3], pl[3]);
#pragma unroll
      for (uint j = 0; j < ATT_HD_MAX / 8; ++j) {
        if (j < nd8) mma_split(o[j], ph, pl, vh, vl, (8 * j + g) * FA_VLD + 2 * tq, lo);
      }
    }
    __syncthreads();
  }
  // A row's sum is spread over its quad; then out = O / l * sigmoid(gate) for the real rows.
  for (uint i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(FULL_MASK, l[i], 1);
    l[i] += __shfl_xor_sync(FULL_MASK, l[i], 2);
  }
#pragma unroll
  for (uint j = 0; j < ATT_HD_MAX / 8; ++j) {
    if (j < nd8) {
      for (uint i = 0; i < 2; ++i) {
        if (!valid[i]) continue;
        const uint d = 8 * j + 2 * tq;
        const float* gate = qrow[i] + hd + d;
        float* dst = out + qi[i] * hd + d;
        dst[0] = o[j][2 * i] / l[i] * sigmoid(gate[0]);
        dst[1] = o[j][2 * i + 1] / l[i] * sigmoid(gate[1]);
      }
    }
  }
}
