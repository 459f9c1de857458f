// Gated full attention (host: ops/attention/metal.rs): q/k norm + RoPE, the KV-cache append (alone
// or fused with the norm + RoPE: decode and prefill use the fused form) and gated GQA attention
// over the cache.
#include "common.h"

// Per-head RMSNorm (weight already 1 + w) of x[0..hd) staged in v: the first half of
// qk_norm_rope and qk_norm_rope_store, one threadgroup per head (ends with a barrier, so any
// thread may then read any v[i]).
inline void stage_normed(constant RopeParams& p, device const float* x, device const float* w, threadgroup float* v,
                         threadgroup float* partial, uint tid, uint ntg, uint sg, uint lane, uint nsg) {
  const uint hd = p.head_dim;
  float ss = 0.0f;
  for (uint i = tid; i < hd; i += ntg) ss += x[i] * x[i];
  const float inv = 1.0f / metal::precise::sqrt(tg_sum(ss, partial, sg, lane, nsg) / float(hd) + p.eps);
  for (uint i = tid; i < hd; i += ntg) v[i] = x[i] * inv * w[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Value i of the staged head after partial rotate-half RoPE on dims 0..rotary_dim at position
// pos: inv_freq_j = theta^(-2j/rotary_dim); angles in f32.
inline float rope_at(constant RopeParams& p, threadgroup const float* v, uint i, float pos) {
  if (i >= p.rotary_dim) return v[i];
  const uint half_rot = p.rotary_dim / 2;
  const uint j = i % half_rot;
  const float inv_freq = metal::precise::pow(p.theta, -2.0f * float(j) / float(p.rotary_dim));
  const float angle = pos * inv_freq;
  const float c = metal::precise::cos(angle), s = metal::precise::sin(angle);
  return i < half_rot ? v[i] * c - v[i + half_rot] * s : v[i] * c + v[i - half_rot] * s;
}

// qk_norm_rope: per-head RMSNorm then partial rotate-half RoPE at position pos0 + t, in place,
// for q inside qg [T, H, 2*hd] (q = first hd values of each head) and k [T, Hkv, hd].
// Bindings: 0 RopeParams, 1 q_norm [hd], 2 k_norm [hd], 3 qg (in/out), 4 k (in/out).
// Grid: threadgroups (H + Hkv, T): heads 0..H-1 are q heads, then the k heads; hd rounded up to
// whole simdgroups, 32 to 256 threads (norm_threads), striding over hd (<= ROPE_HEAD_DIM_MAX); normed values
// staged in threadgroup memory for the rotation.
kernel void qk_norm_rope_f32(constant RopeParams& p [[buffer(0)]], device const float* q_norm [[buffer(1)]],
                             device const float* k_norm [[buffer(2)]], device float* qg [[buffer(3)]],
                             device float* k [[buffer(4)]], uint2 tg [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]], uint ntg [[threads_per_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                             uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  threadgroup float v[ROPE_HEAD_DIM_MAX];
  const uint hh = tg.x, t = tg.y, hd = p.head_dim;
  const bool is_q = hh < p.heads;
  device float* x = is_q ? qg + ((ulong)t * p.heads + hh) * 2 * hd : k + ((ulong)t * p.kv_heads + (hh - p.heads)) * hd;
  stage_normed(p, x, is_q ? q_norm : k_norm, v, partial, tid, ntg, sg, lane, nsg);
  const float pos = float(p.pos0 + t);
  for (uint i = tid; i < hd; i += ntg) x[i] = rope_at(p, v, i, pos);
}

// One entry of a cache's segment table: the GPU address of the segment's first row (the host
// writes MTLBuffer.gpuAddress; Metal 3 argument-buffer pointers). Row r of the cache is row
// r & (2^seg_shift - 1) of segment r >> seg_shift (KvLayout). K: the stored format of the
// cache (common.h: F32, BF16 as bits, F16).
template <typename K> struct KvSegment {
  device typename K::stored* rows;
};

template <typename K>
inline device typename K::stored* kv_row(device const KvSegment<K>* table, constant KvLayout& kl, uint row, uint width) {
  return table[row >> kl.seg_shift].rows + (ulong)(row & ((1u << kl.seg_shift) - 1u)) * width;
}

// kv_store: cache row pos0 + t = x[t, :] rounded to the cache type; x [T, width] f32, the cache's
// segments through its table. Bindings: 0 KvStoreParams, 1 KvLayout, 2 x, 3 table.
// Grid: dispatchThreads (width, T), one element per thread.
template <typename K>
TKERNEL void kv_store(constant KvStoreParams& p [[buffer(0)]], constant KvLayout& kl [[buffer(1)]],
                      device const float* x [[buffer(2)]], device const KvSegment<K>* cache [[buffer(3)]],
                      uint2 pos [[thread_position_in_grid]]) {
  if (pos.x >= p.width || pos.y >= p.tokens) return;
  kv_row(cache, kl, p.pos0 + pos.y, p.width)[pos.x] = K::narrow(x[(ulong)pos.y * p.width + pos.x]);
}
INSTANTIATE(kv_store_f32, kv_store, F32)
INSTANTIATE(kv_store_bf16, kv_store, BF16)
INSTANTIATE(kv_store_f16, kv_store, F16)

// qk_norm_rope_store: qk_norm_rope fused with both kv_store's of an attention layer: q is normed
// and roped in place in qg [T, H, 2*hd]; k [T, Hkv, hd] is normed and roped straight into cache
// row pos0 + t of the K cache (k itself is left as it was); v [T, Hkv, hd] is copied into the V
// cache; both rounded to the cache type K, reached through their segment tables (KvLayout; the
// two caches share it).
// Bindings: 0 RopeParams, 1 KvLayout, 2 q_norm [hd], 3 k_norm [hd], 4 qg (in/out), 5 k, 6 v,
// 7 K table, 8 V table.
// Grid: threadgroups (H + 2 Hkv, T): q heads, then k heads, then v heads; threads as qk_norm_rope.
// Threadgroup memory (arguments: a template kernel cannot declare its own): 0, 32 floats of
// partial sums; 1, the staged head, hd floats.
template <typename K>
TKERNEL void qk_norm_rope_store(constant RopeParams& p [[buffer(0)]], constant KvLayout& kl [[buffer(1)]],
                                device const float* q_norm [[buffer(2)]], device const float* k_norm [[buffer(3)]],
                                device float* qg [[buffer(4)]], device const float* k [[buffer(5)]],
                                device const float* v [[buffer(6)]], device const KvSegment<K>* k_cache [[buffer(7)]],
                                device const KvSegment<K>* v_cache [[buffer(8)]],
                                uint2 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                                uint ntg [[threads_per_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]], uint nsg [[simdgroups_per_threadgroup]],
                                threadgroup float* partial [[threadgroup(0)]],
                                threadgroup float* staged [[threadgroup(1)]]) {
  const uint hh = tg.x, t = tg.y, hd = p.head_dim, kvw = p.kv_heads * hd;
  const float pos = float(p.pos0 + t);
  if (hh < p.heads) {
    device float* x = qg + ((ulong)t * p.heads + hh) * 2 * hd;
    stage_normed(p, x, q_norm, staged, partial, tid, ntg, sg, lane, nsg);
    for (uint i = tid; i < hd; i += ntg) x[i] = rope_at(p, staged, i, pos);
  } else if (hh < p.heads + p.kv_heads) {
    const uint kh = hh - p.heads;
    stage_normed(p, k + (ulong)t * kvw + kh * hd, k_norm, staged, partial, tid, ntg, sg, lane, nsg);
    device typename K::stored* row = kv_row(k_cache, kl, p.pos0 + t, kvw) + kh * hd;
    for (uint i = tid; i < hd; i += ntg) row[i] = K::narrow(rope_at(p, staged, i, pos));
  } else {
    const uint vh = hh - p.heads - p.kv_heads;
    device const float* x = v + (ulong)t * kvw + vh * hd;
    device typename K::stored* row = kv_row(v_cache, kl, p.pos0 + t, kvw) + vh * hd;
    for (uint i = tid; i < hd; i += ntg) row[i] = K::narrow(x[i]);
  }
}
INSTANTIATE(qk_norm_rope_store_f32, qk_norm_rope_store, F32)
INSTANTIATE(qk_norm_rope_store_bf16, qk_norm_rope_store, BF16)
INSTANTIATE(qk_norm_rope_store_f16, qk_norm_rope_store, F16)


// attention: out [T, H*hd] = softmax(q K^T * scale, causal) V * sigmoid(gate), q/gate from
// qg [T, H, 2*hd] (q then gate per head), caches of rows [Hkv, hd] of the cache type K read
// through their segment tables (KvLayout) and widened to f32 as they are staged; token t sees
// rows 0..pos0+t.
// GQA packing: one threadgroup per (KV head, token, split) with G = H / Hkv simdgroups, one per
// query head sharing that KV head; each tile of ATTENTION_TILE K/V rows is loaded once into threadgroup
// memory and read by all G heads. Lanes hold dims lane + 32 i (hd % 32 == 0, hd <= 256).
// A simdgroup scores a tile's rows as independent sums and rescales once per tile: online
// softmax in f32. Split layout (flash-decoding): split z covers cache rows
// [z * split_rows, (z + 1) * split_rows); with splits > 1, out is a partials buffer
// [T, H, splits, 2 + hd] = (running max, sum of exp, unnormalised o) for attention_reduce.
// Bindings: 0 AttentionParams, 1 AttentionSplit, 2 KvLayout, 3 qg, 4 k table, 5 v table, 6 out.
// Grid: threadgroups (Hkv, T, splits), G * 32 threads.
// Threadgroup memory: 0 and 1, the staged K and V tiles, ATTENTION_TILE * hd floats each.
template <typename K>
TKERNEL void attention(constant AttentionParams& p [[buffer(0)]], constant AttentionSplit& sp [[buffer(1)]],
                       constant KvLayout& kl [[buffer(2)]], device const float* qg [[buffer(3)]],
                       device const KvSegment<K>* k_cache [[buffer(4)]], device const KvSegment<K>* v_cache [[buffer(5)]],
                       device float* out [[buffer(6)]], threadgroup float* ks [[threadgroup(0)]],
                       threadgroup float* vs [[threadgroup(1)]], uint3 tg [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]], uint ntg [[threads_per_threadgroup]],
                       uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const uint kvh = tg.x, t = tg.y, split = tg.z;
  const uint hd = p.head_dim, group = p.heads / p.kv_heads, h = kvh * group + sg;
  const uint kvw = p.kv_heads * hd;
  const uint len = p.pos0 + t + 1;
  const uint s0 = split * sp.split_rows;
  const uint s1 = min(len, s0 + sp.split_rows);
  const uint nd = hd / 32;
  device const float* qh = qg + ((ulong)t * p.heads + h) * 2 * hd;
  float q[ATTENTION_HEAD_DIM_MAX / 32], o[ATTENTION_HEAD_DIM_MAX / 32];
  for (uint i = 0; i < nd; ++i) {
    q[i] = qh[lane + 32 * i] * p.scale;
    o[i] = 0.0f;
  }
  float mx = NEG_BIG, l = 0.0f;
  for (uint base = s0; base < s1; base += ATTENTION_TILE) {
    const uint n = min(ATTENTION_TILE, s1 - base);
    for (uint idx = tid; idx < n * hd; idx += ntg) {
      const uint row = base + idx / hd, col = kvh * hd + idx % hd;
      ks[idx] = K::widen(kv_row(k_cache, kl, row, kvw)[col]);
      vs[idx] = K::widen(kv_row(v_cache, kl, row, kvw)[col]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // The tile's scores as independent sums (no dependent chain per row), one rescale per tile.
    float sc[ATTENTION_TILE];
    float m_new = mx;
    for (uint r = 0; r < ATTENTION_TILE; ++r) {
      float a = 0.0f;
      if (r < n)
        for (uint i = 0; i < nd; ++i) a += q[i] * ks[r * hd + lane + 32 * i];
      sc[r] = simd_sum(a);
      if (r < n) m_new = max(m_new, sc[r]);
    }
    const float corr = metal::precise::exp(mx - m_new);
    l *= corr;
    for (uint i = 0; i < nd; ++i) o[i] *= corr;
    for (uint r = 0; r < ATTENTION_TILE; ++r) {
      if (r >= n) break;
      const float e = metal::precise::exp(sc[r] - m_new);
      l += e;
      for (uint i = 0; i < nd; ++i) o[i] += e * vs[r * hd + lane + 32 * i];
    }
    mx = m_new;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (sp.splits == 1) {
    device const float* gate = qh + hd;
    for (uint i = 0; i < nd; ++i) {
      const uint d = lane + 32 * i;
      out[((ulong)t * p.heads + h) * hd + d] = o[i] / l * sigmoid(gate[d]);
    }
  } else {
    device float* part = out + (((ulong)t * p.heads + h) * sp.splits + split) * (hd + 2);
    if (lane == 0) {
      part[0] = mx;
      part[1] = l;
    }
    for (uint i = 0; i < nd; ++i) part[2 + lane + 32 * i] = o[i];
  }
}

INSTANTIATE(attention_f32, attention, F32)
INSTANTIATE(attention_bf16, attention, BF16)
INSTANTIATE(attention_f16, attention, F16)

// attention_reduce: combine the split partials [T, H, splits, 2 + hd] into out [T, H*hd] and
// apply the sigmoid gate from qg. Bindings: 0 AttentionParams, 1 AttentionSplit, 2 partials,
// 3 qg, 4 out. Grid: threadgroups (H, T), 32 threads striding over hd. Accumulation: f32.
kernel void attention_reduce_f32(constant AttentionParams& p [[buffer(0)]], constant AttentionSplit& sp [[buffer(1)]],
                                 device const float* part [[buffer(2)]], device const float* qg [[buffer(3)]],
                                 device float* out [[buffer(4)]], uint2 tg [[threadgroup_position_in_grid]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  const uint h = tg.x, t = tg.y, hd = p.head_dim;
  device const float* ph = part + ((ulong)t * p.heads + h) * sp.splits * (hd + 2);
  float m = NEG_BIG;
  for (uint z = 0; z < sp.splits; ++z) m = max(m, ph[z * (hd + 2)]);
  float l = 0.0f;
  for (uint z = 0; z < sp.splits; ++z) l += ph[z * (hd + 2) + 1] * metal::precise::exp(ph[z * (hd + 2)] - m);
  device const float* gate = qg + ((ulong)t * p.heads + h) * 2 * hd + hd;
  for (uint d = lane; d < hd; d += 32) {
    float acc = 0.0f;
    for (uint z = 0; z < sp.splits; ++z) acc += ph[z * (hd + 2) + 2 + d] * metal::precise::exp(ph[z * (hd + 2)] - m);
    out[((ulong)t * p.heads + h) * hd + d] = acc / l * sigmoid(gate[d]);
  }
}
