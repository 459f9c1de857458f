// kv_store and gated GQA attention over a KV cache read through a segment table (the 16-bit
// segmented cache of issue 13: KvDesc in common.cuh; dtype f32, bf16 or f16, widened to f32 on
// read, rounded to nearest even on store). Positions come from step[0] (pos0 of this forward
// call, in device memory so a captured decode graph replays at any position).
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

// The 16 bytes of K and V cache row `row` from column c on (same dtype and segment size).
__device__ __forceinline__ void kv_load16(const KvDesc kd, const KvDesc vd, uint row, uint c, uint4& k, uint4& v) {
  const size_t at = ((size_t)(row & ((1u << kd.seg_shift) - 1)) * kd.width + c) * (kd.dtype == 0 ? 4 : 2);
  k = load16(reinterpret_cast<const uchar*>(reinterpret_cast<const u64*>(kd.seg)[row >> kd.seg_shift]) + at);
  v = load16(reinterpret_cast<const uchar*>(reinterpret_cast<const u64*>(vd.seg)[row >> vd.seg_shift]) + at);
}

// Stage columns col0 .. col0 + hd of cache rows base .. base + n of K and V as f32 into ks / vs
// ([n][hd]): 16-byte loads (a row's hd values are 16-byte aligned: hd % 32 == 0), issued in batches
// of KV_BATCH per thread and tensor before any is widened, so a thread has 2 KV_BATCH loads in
// flight instead of one dependent (segment table, element) pair at a time.
#define KV_BATCH 4
__device__ __forceinline__ void kv_stage(const KvDesc kd, const KvDesc vd, uint base, uint n, uint col0, uint hd,
                                         float* ks, float* vs) {
  const uint epv = kd.dtype == 0 ? 4 : 8, per_row = hd / epv, total = n * per_row;
  for (uint b0 = 0; b0 < total; b0 += KV_BATCH * blockDim.x) {
    uint4 kv[KV_BATCH], vv[KV_BATCH];
#pragma unroll
    for (int j = 0; j < KV_BATCH; ++j) {
      const uint idx = b0 + j * blockDim.x + threadIdx.x;
      if (idx < total) kv_load16(kd, vd, base + idx / per_row, col0 + (idx % per_row) * epv, kv[j], vv[j]);
    }
#pragma unroll
    for (int j = 0; j < KV_BATCH; ++j) {
      const uint idx = b0 + j * blockDim.x + threadIdx.x;
      if (idx < total) {
        const uint o = (idx / per_row) * hd + (idx % per_row) * epv;
        kv_widen(kd.dtype, kv[j], ks + o);
        kv_widen(vd.dtype, vv[j], vs + o);
      }
    }
  }
}

// Prefetch cache rows base .. base + n of columns col0 .. col0 + hd of K and V into L2 (one
// prefetch per 128-byte line: a row's hd values start 16-byte aligned, so a line is touched by
// at most two threads' pieces), so the next kv_stage waits on L2 instead of memory.
__device__ __forceinline__ void kv_prefetch(const KvDesc kd, const KvDesc vd, uint base, uint n, uint col0, uint hd) {
  const uint bytes = hd * (kd.dtype == 0 ? 4 : 2), lines = (bytes + 127) / 128, total = n * lines;
  for (uint idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const uint row = base + idx / lines, at = (idx % lines) * 128;
    const size_t off = ((size_t)(row & ((1u << kd.seg_shift) - 1)) * kd.width + col0) * (kd.dtype == 0 ? 4 : 2) + at;
    prefetch_l2(reinterpret_cast<const uchar*>(reinterpret_cast<const u64*>(kd.seg)[row >> kd.seg_shift]) + off);
    prefetch_l2(reinterpret_cast<const uchar*>(reinterpret_cast<const u64*>(vd.seg)[row >> vd.seg_shift]) + off);
  }
}

// attention (decode): out = softmax(q K^T * scale, causal) V * sigmoid(gate) for one query token
// per step, split over the keys (flash-decoding); prefill (T > 1) runs attention_prefill below.
// q / gate from qg [T, H, 2*hd] (q then gate per head); token t sees cache rows 0 .. pos0 + t.
// GQA packing: one block per (KV head, token, split) with G = H / Hkv warps, one per query head
// sharing that KV head; each tile of ATT_TILE K/V rows is staged once in shared memory (f32,
// kv_stage) and read by all G heads, and the next tile's rows are prefetched into L2 while this one
// is scored. Lanes hold dims lane + 32 i (hd % 32 == 0, hd <= 256). A warp scores the tile's rows
// together (ATT_TILE independent lane partials and warp sums, not one dependent dot / shuffle /
// exp chain per row), then rescales once per tile: online softmax in f32. Split z of `splits` covers rows [z * rows, (z + 1) * rows) of the causal range,
// rows = ceil(len / splits) rounded up to the tile, so the grid does not depend on the position (a
// decode graph stays valid); out is the partials buffer [T, H, splits, 2 + hd] (running max, sum
// of exp, unnormalised o) for attention_reduce. Arguments: AttentionParams p (pos0 unused), uint
// splits, step, KvDesc k, KvDesc v, qg, partials. Grid (Hkv, T, splits), G * 32 threads.
#define ATT_TILE 16
#define ATT_HD_MAX ATTENTION_HEAD_DIM_MAX
extern "C" __global__ void __launch_bounds__(512, 1) attention(const AttentionParams p, const uint splits,
                                                            const uint* __restrict__ step, const KvDesc kd,
                                                            const KvDesc vd, const float* __restrict__ qg,
                                                            float* __restrict__ out) {
  kernel_start();
  __shared__ float ks[ATT_TILE * ATT_HD_MAX];
  __shared__ float vs[ATT_TILE * ATT_HD_MAX];
  const uint kvh = blockIdx.x, t = blockIdx.y, split = blockIdx.z;
  const uint warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint hd = p.head_dim, group = p.heads / p.kv_heads, h = kvh * group + warp;
  const uint len = step[0] + t + 1;
  const uint per = (len + splits - 1) / splits;
  const uint rows = (per + ATT_TILE - 1) / ATT_TILE * ATT_TILE;
  const uint s0 = min(len, split * rows), s1 = min(len, s0 + rows);
  const uint nd = hd / 32;
  const float* qh = qg + ((size_t)t * p.heads + h) * 2 * hd;
  float q[ATT_HD_MAX / 32], o[ATT_HD_MAX / 32];
  for (uint i = 0; i < ATT_HD_MAX / 32; ++i) {
    q[i] = i < nd ? qh[lane + 32 * i] * p.scale : 0.0f;
    o[i] = 0.0f;
  }
  float mx = NEG_BIG, l = 0.0f;
  for (uint base = s0; base < s1; base += ATT_TILE) {
    const uint n = min((uint)ATT_TILE, s1 - base);
    kv_stage(kd, vd, base, n, kvh * hd, hd, ks, vs);
    __syncthreads();
    if (base + ATT_TILE < s1) kv_prefetch(kd, vd, base + ATT_TILE, min((uint)ATT_TILE, s1 - base - ATT_TILE), kvh * hd, hd);
    // Scores of the tile's rows (rows past n hold an earlier tile's values: never used).
    float sc[ATT_TILE];
#pragma unroll
    for (uint r = 0; r < ATT_TILE; ++r) {
      float a = 0.0f;
#pragma unroll
      for (uint i = 0; i < ATT_HD_MAX / 32; ++i)
        if (i < nd) a += q[i] * ks[r * hd + lane + 32 * i];
      sc[r] = a;
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1)
#pragma unroll
      for (uint r = 0; r < ATT_TILE; ++r) sc[r] += __shfl_xor_sync(FULL_MASK, sc[r], d);
    float m_new = mx;
#pragma unroll
    for (uint r = 0; r < ATT_TILE; ++r)
      if (r < n) m_new = fmaxf(m_new, sc[r]);
    const float corr = expf(mx - m_new);
    l *= corr;
#pragma unroll
    for (uint i = 0; i < ATT_HD_MAX / 32; ++i) o[i] *= corr;
#pragma unroll
    for (uint r = 0; r < ATT_TILE; ++r) {
      if (r >= n) break;
      const float e = expf(sc[r] - m_new);
      l += e;
#pragma unroll
      for (uint i = 0; i < ATT_HD_MAX / 32; ++i)
        if (i < nd) o[i] += e * vs[r * hd + lane + 32 * i];
    }
    mx = m_new;
    __syncthreads();
  }
  float* part = out + (((size_t)t * p.heads + h) * splits + split) * (hd + 2);
  if (lane == 0) {
    part[0] = mx;
    part[1] = l;
  }
#pragma unroll
  for (uint i = 0; i < ATT_HD_MAX / 32; ++i)
    if (i < nd) part[2 + lane + 32 * i] = o[i];
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

// attention_reduce: combine the split partials [T, H, splits, 2 + hd] into out [T, H * hd] and
// apply the sigmoid gate from qg; an empty split (l = 0, max -FLT_MAX) weighs nothing. At most
// ATT_SPLITS_MAX splits (the host's DECODE_SPLITS is checked against it).
// Arguments: AttentionParams p, uint splits, partials, qg, out. Grid (H, T), 256 threads over hd.
#define ATT_SPLITS_MAX 256
extern "C" __global__ void attention_reduce(const AttentionParams p, const uint splits,
                                            const float* __restrict__ part, const float* __restrict__ qg,
                                            float* __restrict__ out) {
  kernel_start();
  // exp(max_z - max): each split's weight, computed once.
  __shared__ float wz[ATT_SPLITS_MAX];
  __shared__ float red[32];
  const uint h = blockIdx.x, t = blockIdx.y, hd = p.head_dim, n = min(splits, (uint)ATT_SPLITS_MAX);
  const float* ph = part + ((size_t)t * p.heads + h) * splits * (hd + 2);
  float mz = NEG_BIG;
  for (uint z = threadIdx.x; z < n; z += blockDim.x) mz = fmaxf(mz, ph[z * (hd + 2)]);
  const float m = block_max(mz, red);
  float lz = 0.0f;
  for (uint z = threadIdx.x; z < n; z += blockDim.x) {
    wz[z] = expf(ph[z * (hd + 2)] - m);
    lz += ph[z * (hd + 2) + 1] * wz[z];
  }
  const float l = block_sum(lz, red);  // its barrier also publishes wz
  const float* gate = qg + ((size_t)t * p.heads + h) * 2 * hd + hd;
  for (uint d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
#pragma unroll 8
    for (uint z = 0; z < n; ++z) acc += ph[z * (hd + 2) + 2 + d] * wz[z];
    out[((size_t)t * p.heads + h) * hd + d] = acc / l * sigmoid(gate[d]);
  }
}
