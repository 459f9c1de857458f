// kv_store and gated GQA attention over a KV cache read through a segment table (the 16-bit
// segmented cache of issue 13: KvDesc in common.cuh; dtype f32, bf16 or f16, widened to f32 on
// read, rounded to nearest even on store). Positions come from step[0] (pos0 of this forward
// call, in device memory so a captured decode graph replays at any position).
#include "common.cuh"

// kv_store: cache[pos0 + t, :] = x[t, :] in the cache dtype; x [T, width] f32. Arguments:
// KvStoreParams p (pos0 unused: step[0]), step, KvDesc cache, x. Grid (ceil(width / 256), T).
extern "C" __global__ void kv_store(const KvStoreParams p, const uint* __restrict__ step, const KvDesc d,
                                    const float* __restrict__ x) {
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

// Stage columns col0 .. col0 + hd of cache rows base .. base + n of K and V as f32 into ks / vs
// ([n][hd]): 16-byte loads (a row's hd values are 16-byte aligned: hd % 32 == 0), issued in batches
// of KV_BATCH per thread and tensor before any is widened, so a thread has 2 KV_BATCH loads in
// flight instead of one dependent (segment table, element) pair at a time.
#define KV_BATCH 4
__device__ __forceinline__ void kv_stage(const KvDesc kd, const KvDesc vd, uint base, uint n, uint col0, uint hd,
                                         float* ks, float* vs) {
  const uint epv = kd.dtype == 0 ? 4 : 8, per_row = hd / epv, total = n * per_row, esize = kd.dtype == 0 ? 4 : 2;
  const uint mask = (1u << kd.seg_shift) - 1;
  for (uint b0 = 0; b0 < total; b0 += KV_BATCH * blockDim.x) {
    uint4 kv[KV_BATCH], vv[KV_BATCH];
#pragma unroll
    for (int j = 0; j < KV_BATCH; ++j) {
      const uint idx = b0 + j * blockDim.x + threadIdx.x;
      if (idx < total) {
        const uint row = base + idx / per_row, c = col0 + (idx % per_row) * epv;
        const size_t at = ((size_t)(row & mask) * kd.width + c) * esize;
        kv[j] = load16(reinterpret_cast<const uchar*>(reinterpret_cast<const u64*>(kd.seg)[row >> kd.seg_shift]) + at);
        vv[j] = load16(reinterpret_cast<const uchar*>(reinterpret_cast<const u64*>(vd.seg)[row >> vd.seg_shift]) + at);
      }
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

// attention: out = softmax(q K^T * scale, causal) V * sigmoid(gate) with q / gate from
// qg [T, H, 2*hd] (q then gate per head); token t sees cache rows 0 .. pos0 + t.
// GQA packing: one block per (KV head, token, split) with G = H / Hkv warps, one per query head
// sharing that KV head; each tile of ATT_TILE K/V rows is staged once in shared memory (f32,
// kv_stage) and read by all G heads. Lanes hold dims lane + 32 i (hd % 32 == 0, hd <= 256). Online softmax in
// f32. Split-KV (flash-decoding): split z of `splits` covers rows [z * rows, (z + 1) * rows) of
// the causal range, rows = ceil(len / splits) rounded up to the tile, so the grid does not depend
// on the position (a decode graph stays valid); with splits > 1, out is the partials buffer
// [T, H, splits, 2 + hd] (running max, sum of exp, unnormalised o) for attention_reduce, else
// out [T, H * hd] directly. Arguments: AttentionParams p (pos0 unused), uint splits, step,
// KvDesc k, KvDesc v, qg, out. Grid (Hkv, T, splits), G * 32 threads.
#define ATT_TILE 16
#define ATT_HD_MAX 256
extern "C" __global__ void __launch_bounds__(512) attention(const AttentionParams p, const uint splits,
                                                            const uint* __restrict__ step, const KvDesc kd,
                                                            const KvDesc vd, const float* __restrict__ qg,
                                                            float* __restrict__ out) {
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
    for (uint r = 0; r < n; ++r) {
      float s = 0.0f;
      for (uint i = 0; i < nd; ++i) s += q[i] * ks[r * hd + lane + 32 * i];
      s = warp_sum(s);
      const float m_new = fmaxf(mx, s);
      const float corr = expf(mx - m_new);
      const float e = expf(s - m_new);
      l = l * corr + e;
      for (uint i = 0; i < nd; ++i) o[i] = o[i] * corr + e * vs[r * hd + lane + 32 * i];
      mx = m_new;
    }
    __syncthreads();
  }
  if (splits == 1) {
    const float* gate = qh + hd;
    for (uint i = 0; i < nd; ++i) {
      const uint d = lane + 32 * i;
      out[((size_t)t * p.heads + h) * hd + d] = o[i] / l * sigmoid(gate[d]);
    }
  } else {
    float* part = out + (((size_t)t * p.heads + h) * splits + split) * (hd + 2);
    if (lane == 0) {
      part[0] = mx;
      part[1] = l;
    }
    for (uint i = 0; i < nd; ++i) part[2 + lane + 32 * i] = o[i];
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
  // exp(max_z - max): each split's weight, computed once.
  __shared__ float wz[ATT_SPLITS_MAX];
  const uint h = blockIdx.x, t = blockIdx.y, hd = p.head_dim, n = min(splits, (uint)ATT_SPLITS_MAX);
  const float* ph = part + ((size_t)t * p.heads + h) * splits * (hd + 2);
  float m = NEG_BIG;
  for (uint z = 0; z < n; ++z) m = fmaxf(m, ph[z * (hd + 2)]);
  for (uint z = threadIdx.x; z < n; z += blockDim.x) wz[z] = expf(ph[z * (hd + 2)] - m);
  __syncthreads();
  float l = 0.0f;
  for (uint z = 0; z < n; ++z) l += ph[z * (hd + 2) + 1] * wz[z];
  const float* gate = qg + ((size_t)t * p.heads + h) * 2 * hd + hd;
  for (uint d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (uint z = 0; z < n; ++z) acc += ph[z * (hd + 2) + 2 + d] * wz[z];
    out[((size_t)t * p.heads + h) * hd + d] = acc / l * sigmoid(gate[d]);
  }
}
