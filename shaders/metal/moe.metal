// Mixture of experts: routing on the GPU and the routed experts (only the selected ones are read).
#include "common.h"

constant constexpr uint ROUTE_E_MAX = 1024;

// moe_route: per token, p = softmax(logits) over all E experts, top K by p (ties: lower id
// first), weights p / sum(top K p) when renorm != 0. logits [T, E], ids [T, K] u32, weights [T, K].
// Bindings: 0 RouteParams, 1 logits, 2 ids, 3 weights. Grid: threadgroups (T), 256 threads
// striding over E (<= 1024); probabilities in threadgroup memory; K rounds of a threadgroup
// argmax (simd_max / simd_min on the id, then across simdgroups by thread 0). f32 throughout.
kernel void moe_route_f32(constant RouteParams& p [[buffer(0)]], device const float* logits [[buffer(1)]],
                          device uint* ids [[buffer(2)]], device float* weights [[buffer(3)]],
                          uint t [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                          uint ntg [[threads_per_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  threadgroup uint partial_id[32];
  threadgroup float pr[ROUTE_E_MAX];
  threadgroup float picked_p[64];
  threadgroup uint picked[64];
  const uint E = p.experts, K = p.top_k;
  device const float* l = logits + (ulong)t * E;
  float m = NEG_BIG;
  for (uint e = tid; e < E; e += ntg) m = max(m, l[e]);
  m = tg_max(m, partial, sg, lane, nsg);
  float z = 0.0f;
  for (uint e = tid; e < E; e += ntg) z += metal::precise::exp(l[e] - m);
  z = tg_sum(z, partial, sg, lane, nsg);
  for (uint e = tid; e < E; e += ntg) pr[e] = metal::precise::exp(l[e] - m) / z;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint k = 0; k < K; ++k) {
    float best = -1.0f;
    uint best_id = 0xffffffffu;
    for (uint e = tid; e < E; e += ntg)
      if (pr[e] > best) {
        best = pr[e];
        best_id = e;
      }
    const float sbest = simd_max(best);
    const uint sid = simd_min(best == sbest ? best_id : 0xffffffffu);
    if (lane == 0) {
      partial[sg] = sbest;
      partial_id[sg] = sid;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
      float bv = partial[0];
      uint bi = partial_id[0];
      for (uint s = 1; s < nsg; ++s)
        if (partial[s] > bv || (partial[s] == bv && partial_id[s] < bi)) {
          bv = partial[s];
          bi = partial_id[s];
        }
      picked[k] = bi;
      picked_p[k] = bv;
      pr[bi] = -1.0f;  // taken
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) {
    float sum = 0.0f;
    for (uint k = 0; k < K; ++k) sum += picked_p[k];
    for (uint k = 0; k < K; ++k) {
      ids[t * K + k] = picked[k];
      weights[t * K + k] = p.renorm != 0 ? picked_p[k] / sum : picked_p[k];
    }
  }
}

// moe_gate_up: act [T*K, I] with act[t*K + k, r] = silu(gate_e[r] . x[t]) * (up_e[r] . x[t]),
// e = ids[t*K + k]; gate/up [E, I, D] in one weight format. Bindings: 0 MoeParams,
// 1 MatrixDesc gate, 2 MatrixDesc up, 3-5 gate w/scales/biases, 6-8 up w/scales/biases,
// 9 x [T, D], 10 ids [T*K], 11 act. Grid: threadgroups (ceil(I / 4), T*K), 128 threads:
// simdgroup per output row (both dot products), lanes over D. Accumulation: f32.
template <typename W>
TKERNEL void moe_gate_up(constant MoeParams& p [[buffer(0)]], constant MatrixDesc& gm [[buffer(1)]],
                         constant MatrixDesc& um [[buffer(2)]], device const uchar* gw [[buffer(3)]],
                         device const uchar* gs [[buffer(4)]], device const uchar* gb [[buffer(5)]],
                         device const uchar* uw [[buffer(6)]], device const uchar* us [[buffer(7)]],
                         device const uchar* ub [[buffer(8)]], device const float* x [[buffer(9)]],
                         device const uint* ids [[buffer(10)]], device float* act [[buffer(11)]],
                         uint2 tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  const uint r = tg.x * 4 + sg, tk = tg.y;
  if (r >= gm.rows) return;
  const uint t = tk / p.top_k, e = ids[tk], D = gm.cols;
  const W g = W::make(gw, gs, gb, gm);
  const W u = W::make(uw, us, ub, um);
  const float gv = row_dot(g, e * gm.expert_stride + gm.row_offset + r, D, x + (ulong)t * D, lane);
  const float uv = row_dot(u, e * um.expert_stride + um.row_offset + r, D, x + (ulong)t * D, lane);
  if (lane == 0) act[(ulong)tk * gm.rows + r] = silu(gv) * uv;
}

// moe_down: y [T*K, D] with y[tk, r] = down_e[r] . act[tk], down [E, D, I]. Bindings:
// 0 MoeParams, 1 MatrixDesc, 2-4 w/scales/biases, 5 ids [T*K], 6 act [T*K, I], 7 y.
// Grid: threadgroups (ceil(D / 4), T*K), 128 threads, simdgroup per output row. f32.
template <typename W>
TKERNEL void moe_down(constant MoeParams& p [[buffer(0)]], constant MatrixDesc& m [[buffer(1)]],
                      device const uchar* w [[buffer(2)]], device const uchar* scales [[buffer(3)]],
                      device const uchar* biases [[buffer(4)]], device const uint* ids [[buffer(5)]],
                      device const float* act [[buffer(6)]], device float* y [[buffer(7)]],
                      uint2 tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  const uint r = tg.x * 4 + sg, tk = tg.y;
  if (r >= m.rows) return;
  const uint e = ids[tk], I = m.cols;
  const W wr = W::make(w, scales, biases, m);
  const float v = row_dot(wr, e * m.expert_stride + m.row_offset + r, I, act + (ulong)tk * I, lane);
  if (lane == 0) y[(ulong)tk * m.rows + r] = v;
}

// moe_combine: out [T, D] = sum_k weights[t, k] * y[t*K + k, :] (k ascending, f32).
// Bindings: 0 MoeParams, 1 RowsParams (T, D), 2 weights [T, K], 3 y [T*K, D], 4 out.
// Grid: dispatchThreads (D, T).
kernel void moe_combine_f32(constant MoeParams& p [[buffer(0)]], constant RowsParams& rp [[buffer(1)]],
                            device const float* weights [[buffer(2)]], device const float* y [[buffer(3)]],
                            device float* out [[buffer(4)]], uint2 pos [[thread_position_in_grid]]) {
  if (pos.x >= rp.dim || pos.y >= rp.tokens) return;
  const uint t = pos.y, K = p.top_k;
  float acc = 0.0f;
  for (uint k = 0; k < K; ++k) acc += weights[t * K + k] * y[((ulong)t * K + k) * rp.dim + pos.x];
  out[(ulong)t * rp.dim + pos.x] = acc;
}

#define MOE(sfx) INSTANTIATE(moe_gate_up_##sfx, moe_gate_up, W_##sfx) INSTANTIATE(moe_down_##sfx, moe_down, W_##sfx)
FOR_EACH_WEIGHT(MOE)
