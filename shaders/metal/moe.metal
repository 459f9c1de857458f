// Mixture of experts: routing on the GPU and the routed experts (only the selected ones are read).
// Host: ops/moe/metal.rs.
#include "common.h"

// Router logit x as a finite value, decided on its bits (Apple's fast math may assume floats are
// never NaN or infinite, so float compares cannot be trusted to catch them): NaN and -inf become
// -FLT_MAX (NaN ranks as -inf), +inf becomes FLT_MAX, finite values are unchanged.
inline float route_logit(float x) {
  const uint b = as_type<uint>(x);
  if ((b & 0x7fffffffu) < 0x7f800000u) return x;  // finite
  return b == 0x7f800000u ? -NEG_BIG : NEG_BIG;
}

// exp(x - m) for route_logit values x <= m (m their maximum): exactly 0 where it underflows
// (x < m - 110; e^-104 is already below the smallest f32), so x - m never overflows.
inline float route_exp(float x, float m) { return x >= m - 110.0f ? metal::precise::exp(x - m) : 0.0f; }

// The routing of one token by a whole threadgroup: p = softmax over all E experts, top K by p
// (ties: lower id first), weights p / sum(top K p) when renorm != 0, into ids [K] and weights [K].
// On entry key[0..E) holds the token's route_logit'ed logits as float bits, each entry written by
// the thread that reads it first here (e = tid + i ntg), and m that thread's maximum of its entries;
// key[] then becomes the integer keys: the bits of p + 1, 0 for "taken" (p in [0, 1]: its bits order
// like its value), so the K rounds of the threadgroup argmax (simd_max / simd_min on the id, then
// across simdgroups by thread 0) always pick K distinct ids < E, the same on every run, whatever the
// input. Non-finite logits (route_logit): NaN ranks as -inf; +inf logits share the probability
// equally (the softmax limit), every finite one gets 0; when every logit is NaN or -inf, every
// expert gets 1/E (so the top K are the lowest ids). `tgm`: ROUTE_TG_WORDS (params.h) words of
// threadgroup memory (partial, partial_key, partial_id [32 each], picked_p, picked [ROUTE_TOP_K_MAX each]).
// f32 throughout; reached by every thread of the threadgroup.
inline void route_token(uint E, uint K, uint renorm, float m, threadgroup uint* key, threadgroup uint* tgm,
                        device uint* ids, device float* weights, uint tid, uint ntg, uint sg, uint lane, uint nsg) {
  threadgroup float* partial = (threadgroup float*)tgm;
  threadgroup uint* partial_key = tgm + 32;
  threadgroup uint* partial_id = tgm + 64;
  threadgroup float* picked_p = (threadgroup float*)(tgm + 96);
  threadgroup uint* picked = tgm + 96 + ROUTE_TOP_K_MAX;
  m = tg_max(m, partial, sg, lane, nsg);
  float z = 0.0f;
  for (uint e = tid; e < E; e += ntg) z += route_exp(as_type<float>(key[e]), m);
  z = tg_sum(z, partial, sg, lane, nsg);  // >= 1: the maximum contributes exp(0)
  for (uint e = tid; e < E; e += ntg) {
    const uint b = as_type<uint>(route_exp(as_type<float>(key[e]), m) / z);
    key[e] = (b >> 31) != 0u ? 1u : min(b, 0x7f800000u) + 1u;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint k = 0; k < K; ++k) {
    uint best = 0u, best_id = E;  // nothing yet: loses to any untaken expert
    for (uint e = tid; e < E; e += ntg)
      if (key[e] > best) {
        best = key[e];
        best_id = e;
      }
    const uint sbest = simd_max(best);
    const uint sid = simd_min(best == sbest ? best_id : 0xffffffffu);
    if (lane == 0) {
      partial_key[sg] = sbest;
      partial_id[sg] = sid;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
      uint bv = partial_key[0], bi = partial_id[0];
      for (uint s = 1; s < nsg; ++s)
        if (partial_key[s] > bv || (partial_key[s] == bv && partial_id[s] < bi)) {
          bv = partial_key[s];
          bi = partial_id[s];
        }
      // bv >= 1 and bi < E: K <= E leaves an untaken expert in every round.
      picked[k] = bi;
      picked_p[k] = as_type<float>(bv - 1u);
      if (bi < E) key[bi] = 0u;  // taken
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) {
    float sum = 0.0f;
    for (uint k = 0; k < K; ++k) sum += picked_p[k];
    for (uint k = 0; k < K; ++k) {
      ids[k] = picked[k];
      weights[k] = renorm != 0 ? picked_p[k] / sum : picked_p[k];
    }
  }
}

// moe_route: route_token for each token of logits [T, E] into ids [T, K] u32 and weights [T, K].
// Bindings: 0 RouteParams, 1 logits, 2 ids, 3 weights. Grid: threadgroups (T), 256 threads striding
// over E (<= MOE_EXPERTS_MAX).
kernel void moe_route_f32(constant RouteParams& p [[buffer(0)]], device const float* logits [[buffer(1)]],
                          device uint* ids [[buffer(2)]], device float* weights [[buffer(3)]],
                          uint t [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                          uint ntg [[threads_per_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup uint key[MOE_EXPERTS_MAX];
  threadgroup uint tgm[ROUTE_TG_WORDS];
  // The host checks E <= MOE_EXPERTS_MAX and K <= min(E, ROUTE_TOP_K_MAX); clamped here too, so no index can leave the
  // threadgroup arrays and every round has an expert left to take.
  const uint E = min(p.experts, MOE_EXPERTS_MAX), K = min(p.top_k, min(E, ROUTE_TOP_K_MAX));
  device const float* l = logits + (ulong)t * p.experts;
  float m = NEG_BIG;
  for (uint e = tid; e < E; e += ntg) {
    const float v = route_logit(l[e]);
    key[e] = as_type<uint>(v);
    m = max(m, v);
  }
  route_token(E, K, p.renorm, m, key, tgm, ids + t * p.top_k, weights + t * p.top_k, tid, ntg, sg, lane, nsg);
}

// moe_router_<w>_r<R>: the MoE block's routing from its input for one decode token in one dispatch:
// logits = x router^T [E] and shared = x shared_gate^T [1] (router [E, D], shared_gate [1, D], one
// weight format), then route_token on the logits into ids [K] and weights [K] (moe_route's result).
// Bindings: 0 RouteParams (T = 1), 1 MatrixDesc router, 2 MatrixDesc shared gate, 3-5 router w /
// scales / biases, 6-8 shared gate w / scales / biases, 9 x [D], 10 shared [1], 11 mail [E + 1] u32
// (0 between dispatches), 12 ids, 13 weights; threadgroup(0) key [E] u32, threadgroup(1)
// ROUTE_TG_WORDS u32. Grid: threadgroups (ceil(E / (4 R)) + 1), 128 threads = 4 simdgroups: in the
// first ceil(E / (4 R)) simdgroup s of threadgroup g owns router rows (4 g + s) R .. + R (matmul_gemv's
// layout: rows_dot), in the last one simdgroup 0 owns the shared gate's row. Last-threadgroup-done,
// in what MSL 3.0 guarantees across threadgroups (relaxed device atomics: each location coherent,
// no ordering between locations): lane 0 stores each logit's bits with an atomic store into mail[e]
// (bits 0, +0.0, stored as -0.0, which routes the same: 0 stays "not written yet"); after a
// threadgroup barrier thread 0 adds 1 to the counter mail[E]; the threadgroup that reads ceil(E / 4R)
// (every router threadgroup counted before it) takes each mail[e] by atomic exchange with 0, trying
// again while it reads 0 (a store its threadgroup has already issued and not yet made visible), so
// it reads every logit and leaves mail[] zero; it resets the counter and routes. Why not one
// threadgroup for the whole GEMV: the router is 256 x 2048 8-bit codes (~0.55 MB with scales), which
// one GPU core streams several times slower than 16-32 threadgroups; the routing tail (E values, K
// argmax rounds) costs the last threadgroup a few barriers instead of two dispatches (the shared gate
// GEMV and moe_route). The logits are not stored elsewhere.
template <typename W, int R>
TKERNEL void moe_router(constant RouteParams& p [[buffer(0)]], constant MatrixDesc& rm [[buffer(1)]],
                        constant MatrixDesc& sm [[buffer(2)]], device const uchar* rw [[buffer(3)]],
                        device const uchar* rs [[buffer(4)]], device const uchar* rb [[buffer(5)]],
                        device const uchar* sw [[buffer(6)]], device const uchar* ss [[buffer(7)]],
                        device const uchar* sb [[buffer(8)]], device const float* x [[buffer(9)]],
                        device float* shared [[buffer(10)]], device atomic_uint* mail [[buffer(11)]],
                        device uint* ids [[buffer(12)]], device float* weights [[buffer(13)]],
                        threadgroup uint* key [[threadgroup(0)]], threadgroup uint* tgm [[threadgroup(1)]],
                        uint3 tg [[threadgroup_position_in_grid]], uint3 ntgs [[threadgroups_per_grid]],
                        uint tid [[thread_index_in_threadgroup]], uint ntg [[threads_per_threadgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                        uint nsg [[simdgroups_per_threadgroup]]) {
  const uint E = min(p.experts, MOE_EXPERTS_MAX), K = min(p.top_k, min(E, ROUTE_TOP_K_MAX));
  const uint routers = ntgs.x - 1;  // router threadgroups; the last one computes the shared gate
  if (tg.x == routers) {
    if (sg == 0) {
      const W wr = W::make(sw, ss, sb, sm);
      float dot[1];
      rows_dot<W, 1>(wr, sm.row_offset, 1, sm.cols, x, lane, dot);
      if (lane == 0) shared[0] = dot[0];
    }
    return;  // whole threadgroup: no barrier follows
  }
  const uint r0 = (tg.x * nsg + sg) * R;
  if (r0 < E) {  // whole simdgroup
    const uint nr = min((uint)R, E - r0);
    const W wr = W::make(rw, rs, rb, rm);
    float dots[R];
    rows_dot<W, R>(wr, rm.row_offset + r0, nr, rm.cols, x, lane, dots);
    if (lane == 0)
      for (uint r = 0; r < nr; ++r) {
        const uint b = as_type<uint>(dots[r]);
        atomic_store_explicit(&mail[r0 + r], b != 0u ? b : 0x80000000u, memory_order_relaxed);
      }
  }
  threadgroup_barrier(mem_flags::mem_device);
  if (tid == 0) tgm[0] = atomic_fetch_add_explicit(&mail[E], 1u, memory_order_relaxed) == routers - 1 ? 1u : 0u;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const bool last = tgm[0] != 0u;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // tgm is route_token's scratch next
  if (!last) return;  // whole threadgroup
  float m = NEG_BIG;
  for (uint e = tid; e < E; e += ntg) {
    uint b = 0u;
    while (b == 0u) b = atomic_exchange_explicit(&mail[e], 0u, memory_order_relaxed);
    const float v = route_logit(as_type<float>(b));
    key[e] = as_type<uint>(v);
    m = max(m, v);
  }
  if (tid == 0) atomic_store_explicit(&mail[E], 0u, memory_order_relaxed);
  route_token(E, K, p.renorm, m, key, tgm, ids, weights, tid, ntg, sg, lane, nsg);
}

// gate_up_rows: out[r] = silu(g row grow + r . x) * (u row urow + r . x) for r < nr, written by
// lane 0 (rows_dot in common.h for the gate rows, then the up rows; lanes over D): the body of
// moe_gate_up and gate_up_swiglu.
template <typename W, int R>
inline void gate_up_rows(thread const W& g, uint grow, thread const W& u, uint urow, uint nr, uint D,
                         device const float* x, uint lane, device float* out) {
  float gv[R], uv[R];
  rows_dot<W, R>(g, grow, nr, D, x, lane, gv);
  rows_dot<W, R>(u, urow, nr, D, x, lane, uv);
  if (lane == 0)
    for (uint r = 0; r < nr; ++r) out[r] = silu(gv[r]) * uv[r];
}

// moe_gate_up_<w>_r<R>: act [P, I] with act[t*K + k, r] = silu(gate_e[r] . x[t]) * (up_e[r] . x[t]),
// e = ids[t*K + k]; gate/up [E, I, D] in one weight format. P = T*K, or T*K + T with the shared
// expert as pairs (ops/moe/metal.rs `moe_add_rms_norm`): pair T*K + t is token t's shared expert,
// sgate/sup [I, D] (plain matrices of the experts' format and shape, read as expert 0), so its
// act rows, and moe_down's y rows, follow the T*K routed ones as one [T, *] block. Bindings:
// 0 MoeParams, 1 MatrixDesc gate, 2 MatrixDesc up, 3-5 gate w/scales/biases, 6-8 up
// w/scales/biases, 9 x [T, D], 10 ids [T*K], 11 act, 12 MatrixDesc sgate, 13 MatrixDesc sup,
// 14-16 sgate w/scales/biases, 17-19 sup w/scales/biases (without shared pairs: gate's and up's
// again, never read). Grid: threadgroups (ceil(I / (4 R)), P), 128 threads = 4 simdgroups;
// simdgroup s owns the R rows (4 tg.x + s) R .. + R of pair tg.y (rows_dot in common.h for the
// gate rows, then the up rows; lanes over D). R = 2 on Apple7/8, 4 on Apple9+ (kernels.rs).
// Accumulation: f32.
template <typename W, int R>
TKERNEL void moe_gate_up(constant MoeParams& p [[buffer(0)]], constant MatrixDesc& gm [[buffer(1)]],
                         constant MatrixDesc& um [[buffer(2)]], device const uchar* gw [[buffer(3)]],
                         device const uchar* gs [[buffer(4)]], device const uchar* gb [[buffer(5)]],
                         device const uchar* uw [[buffer(6)]], device const uchar* us [[buffer(7)]],
                         device const uchar* ub [[buffer(8)]], device const float* x [[buffer(9)]],
                         device const uint* ids [[buffer(10)]], device float* act [[buffer(11)]],
                         constant MatrixDesc& sgm [[buffer(12)]], constant MatrixDesc& sud [[buffer(13)]],
                         device const uchar* sgw [[buffer(14)]], device const uchar* sgs [[buffer(15)]],
                         device const uchar* sgb [[buffer(16)]], device const uchar* suw [[buffer(17)]],
                         device const uchar* sus [[buffer(18)]], device const uchar* sub [[buffer(19)]],
                         uint2 tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
  const uint r0 = (tg.x * nsg + sg) * R, tk = tg.y, routed = p.tokens * p.top_k;
  if (r0 >= gm.rows) return;  // whole simdgroup
  const uint nr = min((uint)R, gm.rows - r0);
  device float* out = act + (ulong)tk * gm.rows + r0;
  if (tk >= routed) {  // token tk - T*K's shared expert
    const W g = W::make(sgw, sgs, sgb, sgm);
    const W u = W::make(suw, sus, sub, sud);
    gate_up_rows<W, R>(g, sgm.row_offset + r0, u, sud.row_offset + r0, nr, gm.cols,
                       x + (ulong)(tk - routed) * gm.cols, lane, out);
    return;
  }
  const uint t = tk / p.top_k, e = ids[tk];
  const W g = W::make(gw, gs, gb, gm);
  const W u = W::make(uw, us, ub, um);
  gate_up_rows<W, R>(g, e * gm.expert_stride + gm.row_offset + r0, u, e * um.expert_stride + um.row_offset + r0, nr,
                     gm.cols, x + (ulong)t * gm.cols, lane, out);
}

// gate_up_swiglu_<w>_r<R>: out [T, N] = silu(x gate^T) * (x up^T) for one pair of matrices gate,
// up [N, K] in one weight format (the MoE block's shared expert: moe_gate_up's body on expert 0 of
// plain matrices, one dispatch instead of two GEMVs and a swiglu). Bindings: 0 RowsParams (T, N),
// 1 MatrixDesc gate, 2 MatrixDesc up, 3-5 gate w/scales/biases, 6-8 up w/scales/biases, 9 x [T, K],
// 10 out. Grid: threadgroups (ceil(N / (4 R)), T), 128 threads = 4 simdgroups; simdgroup s owns the
// R rows (4 tg.x + s) R .. + R of token tg.y (gate_up_rows; lanes over K). Accumulation: f32.
template <typename W, int R>
TKERNEL void gate_up_swiglu(constant RowsParams& p [[buffer(0)]], constant MatrixDesc& gm [[buffer(1)]],
                            constant MatrixDesc& um [[buffer(2)]], device const uchar* gw [[buffer(3)]],
                            device const uchar* gs [[buffer(4)]], device const uchar* gb [[buffer(5)]],
                            device const uchar* uw [[buffer(6)]], device const uchar* us [[buffer(7)]],
                            device const uchar* ub [[buffer(8)]], device const float* x [[buffer(9)]],
                            device float* out [[buffer(10)]], uint2 tg [[threadgroup_position_in_grid]],
                            uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                            uint nsg [[simdgroups_per_threadgroup]]) {
  const uint r0 = (tg.x * nsg + sg) * R, t = tg.y;
  if (r0 >= gm.rows || t >= p.tokens) return;  // whole simdgroup
  const uint nr = min((uint)R, gm.rows - r0);
  const W g = W::make(gw, gs, gb, gm);
  const W u = W::make(uw, us, ub, um);
  gate_up_rows<W, R>(g, gm.row_offset + r0, u, um.row_offset + r0, nr, gm.cols, x + (ulong)t * gm.cols, lane,
                     out + (ulong)t * gm.rows + r0);
}

// moe_down_<w>_r<R>: y [P, D] with y[tk, r] = down_e[r] . act[tk], down [E, D, I]; P and the
// shared pairs as moe_gate_up (pair T*K + t: sdown [D, I], read as expert 0). Bindings:
// 0 MoeParams, 1 MatrixDesc, 2-4 w/scales/biases, 5 ids [T*K], 6 act [P, I], 7 y, 8 MatrixDesc
// sdown, 9-11 sdown w/scales/biases (without shared pairs: down's again, never read).
// Grid: threadgroups (ceil(D / (4 R)), P), 128 threads, R rows per simdgroup as moe_gate_up.
// Accumulation: f32.
template <typename W, int R>
TKERNEL void moe_down(constant MoeParams& p [[buffer(0)]], constant MatrixDesc& m [[buffer(1)]],
                      device const uchar* w [[buffer(2)]], device const uchar* scales [[buffer(3)]],
                      device const uchar* biases [[buffer(4)]], device const uint* ids [[buffer(5)]],
                      device const float* act [[buffer(6)]], device float* y [[buffer(7)]],
                      constant MatrixDesc& sm [[buffer(8)]], device const uchar* sw [[buffer(9)]],
                      device const uchar* ss [[buffer(10)]], device const uchar* sb [[buffer(11)]],
                      uint2 tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
  const uint r0 = (tg.x * nsg + sg) * R, tk = tg.y;
  if (r0 >= m.rows) return;  // whole simdgroup
  const uint nr = min((uint)R, m.rows - r0);
  const uint I = m.cols;
  const bool shared = tk >= p.tokens * p.top_k;
  const W wr = shared ? W::make(sw, ss, sb, sm) : W::make(w, scales, biases, m);
  const uint row0 = shared ? sm.row_offset + r0 : ids[tk] * m.expert_stride + m.row_offset + r0;
  float v[R];
  rows_dot<W, R>(wr, row0, nr, I, act + (ulong)tk * I, lane, v);
  if (lane == 0)
    for (uint r = 0; r < nr; ++r) y[(ulong)tk * m.rows + r0 + r] = v[r];
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


// ---- Prefill (T > a threshold): expert-sorted GEMMs, routed entirely on the GPU ----------------
// After moe_route (ids [T, K]) one command stream runs: moe_histogram (tokens per expert per sort
// block) -> moe_scan (exclusive prefix scan: row offsets of each expert in expert-sorted order,
// and a block map of MOE_TILE-row blocks) -> moe_scatter ((token, slot) pairs into sorted order)
// -> moe_gemm_gate_up (act = SwiGLU over each expert's gathered tokens) -> moe_gemm_down (y) ->
// moe_combine_sorted (out [T, D], k ascending). Pair p = t*K + k. Within one expert, pairs are
// sorted by p (a stable counting sort, no atomics), so every buffer is the same on every run.
// Scratch (u32, owned by the backend): count [4] (count[0] = number of blocks), blocks
// [max_blocks, 4] (expert, first sorted row, rows <= MOE_TILE, 0), hist [token_blocks, E],
// order [T*K] (sorted row -> p), pos [T*K] (p -> sorted row).

// Threadgroup exclusive prefix sum of one uint per thread: (sum of v over lower thread indices,
// total over the threadgroup). Threads per threadgroup a multiple of 32; `partial` holds one
// uint per simdgroup. Must be reached by every thread.
inline uint2 tg_scan_exclusive(uint v, threadgroup uint* partial, uint sg, uint lane, uint nsg) {
  const uint pre = simd_prefix_exclusive_sum(v);
  if (lane == 31) partial[sg] = pre + v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint before = 0, all = 0;
  for (uint s = 0; s < nsg; ++s) {
    const uint q = partial[s];
    if (s < sg) before += q;
    all += q;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // partial is reused by the next call
  return uint2(before + pre, all);
}

// moe_histogram: hist[b, e] = number of pairs of sort block b (tokens b*S .. b*S+S-1, S =
// sort_tokens) routed to expert e. Bindings: 0 MoeParams, 1 MoeSortDesc, 2 ids [T*K], 3 hist
// [token_blocks, E]. Grid: dispatchThreads (E, token_blocks); each thread scans its block's ids.
kernel void moe_histogram_u32(constant MoeParams& p [[buffer(0)]], constant MoeSortDesc& s [[buffer(1)]],
                              device const uint* ids [[buffer(2)]], device uint* hist [[buffer(3)]],
                              uint2 pos [[thread_position_in_grid]]) {
  const uint e = pos.x, b = pos.y;
  if (e >= s.experts || b >= s.token_blocks) return;
  const uint p0 = b * s.sort_tokens * p.top_k;
  const uint p1 = min(p0 + s.sort_tokens * p.top_k, p.tokens * p.top_k);
  uint c = 0;
  for (uint i = p0; i < p1; ++i) c += ids[i] == e ? 1u : 0u;
  hist[b * s.experts + e] = c;
}

// moe_scan: one threadgroup, thread e owns expert e (threads: E rounded up to 32, E <=
// MOE_EXPERTS_MAX).
// In place, hist[b, e] becomes the first sorted row of block b's pairs of expert e (the running
// count over b plus the exclusive scan of the expert totals); the block map gets ceil(n_e / 32)
// entries per expert (exclusive scan of the block counts), count[0] the number of blocks.
// Bindings: 0 MoeParams, 1 MoeSortDesc, 2 hist, 3 count [4], 4 blocks [max_blocks, 4].
// Grid: threadgroups (1), threads ceil(E / 32) * 32. Integer sums (exact).
kernel void moe_scan_u32(constant MoeParams& p [[buffer(0)]], constant MoeSortDesc& s [[buffer(1)]],
                         device uint* hist [[buffer(2)]], device uint* count [[buffer(3)]],
                         device uint* blocks [[buffer(4)]], uint e [[thread_index_in_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                         uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup uint partial[32];
  const uint E = s.experts;
  uint total = 0;
  if (e < E)
    for (uint b = 0; b < s.token_blocks; ++b) {
      const uint c = hist[b * E + e];
      hist[b * E + e] = total;
      total += c;
    }
  const uint off = tg_scan_exclusive(total, partial, sg, lane, nsg).x;
  if (e < E)
    for (uint b = 0; b < s.token_blocks; ++b) hist[b * E + e] += off;
  const uint nb = (total + MOE_TILE - 1) / MOE_TILE;
  const uint2 bo = tg_scan_exclusive(nb, partial, sg, lane, nsg);
  for (uint j = 0; j < nb && bo.x + j < s.max_blocks; ++j) {
    device uint* m = blocks + 4 * (bo.x + j);
    m[0] = e;
    m[1] = off + j * MOE_TILE;
    m[2] = min(MOE_TILE, total - j * MOE_TILE);
    m[3] = 0;
  }
  if (e == 0) count[0] = min(bo.y, s.max_blocks);
}

// moe_scatter: thread (e, b) walks sort block b's pairs in order and gives those of expert e
// consecutive sorted rows from hist[b, e]: order[row] = p, pos[p] = row. Bindings: 0 MoeParams,
// 1 MoeSortDesc, 2 ids [T*K], 3 hist (first rows, from moe_scan), 4 order [T*K], 5 pos [T*K].
// Grid: dispatchThreads (E, token_blocks).
kernel void moe_scatter_u32(constant MoeParams& p [[buffer(0)]], constant MoeSortDesc& s [[buffer(1)]],
                            device const uint* ids [[buffer(2)]], device const uint* hist [[buffer(3)]],
                            device uint* order [[buffer(4)]], device uint* pos [[buffer(5)]],
                            uint2 gid [[thread_position_in_grid]]) {
  const uint e = gid.x, b = gid.y;
  if (e >= s.experts || b >= s.token_blocks) return;
  const uint p0 = b * s.sort_tokens * p.top_k;
  const uint p1 = min(p0 + s.sort_tokens * p.top_k, p.tokens * p.top_k);
  uint row = hist[b * s.experts + e];
  for (uint i = p0; i < p1; ++i)
    if (ids[i] == e) {
      order[row] = i;
      pos[i] = row;
      ++row;
    }
}

// Stage 8 weights of stored row `row` from column j into wd (zero where !valid or past K).
template <typename W>
inline void moe_stage_w8(thread const W& wr, uint row, bool valid, uint j, uint K, threadgroup float* wd) {
  if (valid && j + 8 <= K) {
    float wv[8];
    wr.load8(row, j, wv);
    for (int i = 0; i < 8; ++i) wd[i] = wv[i];
  } else {
    for (uint i = 0; i < 8; ++i) wd[i] = valid && j + i < K ? wr.at(row, j + i) : 0.0f;
  }
}

// Stage 8 activations of row xr from column j into xd (zero where xr is null or past K).
inline void moe_stage_x8(device const float* xr, bool valid, uint j, uint K, threadgroup float* xd) {
  for (uint i = 0; i < 8; ++i) xd[i] = valid && j + i < K ? xr[j + i] : 0.0f;
}

// moe_gemm_gate_up_<w>_n<TN>: for block j of the map (expert e, sorted rows r0 .. r0 + nr,
// nr <= 32), act[r0 + i, n] = silu(gate_e[n] . x[t_i]) * (up_e[n] . x[t_i]), t_i = order[r0 + i] / K;
// gate/up [E, I, D] (MatrixDesc views), x [T, D], act [T*K, I] in sorted row order.
// Bindings: 0 MoeParams, 1 MatrixDesc gate, 2 MatrixDesc up, 3-5 gate w/scales/biases, 6-8 up,
// 9 x, 10 count, 11 blocks, 12 order, 13 act. Grid: threadgroups (ceil(I / TN), max_blocks)
// (groups past count[0] return at once), 128 threads = 4 simdgroups in 2x2, each owning a
// 16 x TN/2 (tokens x rows) sub-tile of the 32 x TN tile as 2 x (TN / 16) 8x8 f32 accumulators
// for gate and for up. TN = 32 on Apple7/8, 64 on Apple9+ (kernels.rs): 64 halves the x gathers
// per weight and doubles the accumulators (16 8x8 matrices per simdgroup). Per K step of 32 the
// threadgroup stages the gathered x [32 tokens][32] and the dequantized gate and up rows
// [TN][32] as f32 (zero outside nr, I and D; thread i fills 8 columns of x row i / 4 and of
// weight rows i / 4 + 32 j), so the expert's weights are read once per 32 tokens. The results
// leave through the weight tiles' memory as [32 tokens][TN rows]. Accumulation: f32, the same
// order for every TN. Threadgroup memory: argument 0 32 * 32 floats, arguments 1 and 2 TN * 32
// floats each, sized by the host.
template <typename W, int TN>
TKERNEL void moe_gemm_gate_up(constant MoeParams& p [[buffer(0)]], constant MatrixDesc& gm [[buffer(1)]],
                              constant MatrixDesc& um [[buffer(2)]], device const uchar* gw [[buffer(3)]],
                              device const uchar* gsc [[buffer(4)]], device const uchar* gbi [[buffer(5)]],
                              device const uchar* uw [[buffer(6)]], device const uchar* usc [[buffer(7)]],
                              device const uchar* ubi [[buffer(8)]], device const float* x [[buffer(9)]],
                              device const uint* count [[buffer(10)]], device const uint* blocks [[buffer(11)]],
                              device const uint* order [[buffer(12)]], device float* act [[buffer(13)]],
                              threadgroup float* xs [[threadgroup(0)]],  // [token][k]
                              threadgroup float* gt [[threadgroup(1)]],  // gate [row][k], then gate out [token][row]
                              threadgroup float* ut [[threadgroup(2)]],  // up [row][k], then up out [token][row]
                              uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int NB = TN / 16;
  if (tg.y >= count[0]) return;  // whole threadgroup
  device const uint* blk = blocks + 4 * tg.y;
  const uint e = blk[0], r0 = blk[1], nr = blk[2];
  const W g = W::make(gw, gsc, gbi, gm);
  const W u = W::make(uw, usc, ubi, um);
  const uint K = gm.cols, N = gm.rows, n0 = tg.x * TN;
  const uint st = (sg / 2) * 16, sn = (sg % 2) * (TN / 2);
  const uint lr = tid / 4, lc = (tid % 4) * 8;
  const bool has_x = lr < nr;
  device const float* xr = x + (ulong)(has_x ? order[r0 + lr] / p.top_k : 0) * K;
  const uint grow = e * gm.expert_stride + gm.row_offset + n0;
  const uint urow = e * um.expert_stride + um.row_offset + n0;
  simdgroup_float8x8 ag[2][NB], au[2][NB];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < NB; ++j) {
      ag[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      au[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  for (uint k0 = 0; k0 < K; k0 += MOE_TILE) {
    const uint j = k0 + lc;
    moe_stage_x8(xr, has_x, j, K, xs + lr * MOE_TILE + lc);
    for (uint rr = lr; rr < (uint)TN; rr += MOE_TILE) {
      const bool has_w = n0 + rr < N;
      moe_stage_w8(g, grow + rr, has_w, j, K, gt + rr * MOE_TILE + lc);
      moe_stage_w8(u, urow + rr, has_w, j, K, ut + rr * MOE_TILE + lc);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < MOE_TILE; kk += 8) {
      simdgroup_float8x8 a[2], bg[NB], bu[NB];
      for (uint i = 0; i < 2; ++i) simdgroup_load(a[i], xs + (st + 8 * i) * MOE_TILE + kk, MOE_TILE);
      for (uint i = 0; i < (uint)NB; ++i) {  // transposed: b[k][n] = W[sn + 8 i + n][kk + k]
        simdgroup_load(bg[i], gt + (sn + 8 * i) * MOE_TILE + kk, MOE_TILE, ulong2(0, 0), true);
        simdgroup_load(bu[i], ut + (sn + 8 * i) * MOE_TILE + kk, MOE_TILE, ulong2(0, 0), true);
      }
      for (int i = 0; i < 2; ++i)
        for (int jj = 0; jj < NB; ++jj) {
          simdgroup_multiply_accumulate(ag[i][jj], a[i], bg[jj], ag[i][jj]);
          simdgroup_multiply_accumulate(au[i][jj], a[i], bu[jj], au[i][jj]);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < 2; ++i)
    for (uint jj = 0; jj < (uint)NB; ++jj) {
      simdgroup_store(ag[i][jj], gt + (st + 8 * i) * TN + sn + 8 * jj, TN);
      simdgroup_store(au[i][jj], ut + (st + 8 * i) * TN + sn + 8 * jj, TN);
    }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint q = tid; q < MOE_TILE * (uint)TN; q += 128) {
    const uint i = q / TN, n = n0 + q % TN;
    if (i < nr && n < N) act[(ulong)(r0 + i) * N + n] = silu(gt[q]) * ut[q];
  }
}

// moe_gemm_down_<w>_n<TN>: for block j of the map (expert e, sorted rows r0 .. r0 + nr),
// y[r0 + i, n] = down_e[n] . act[r0 + i]; down [E, D, I], act [T*K, I] and y [T*K, D] in sorted
// row order (the block's rows are contiguous). Bindings: 0 MoeParams, 1 MatrixDesc, 2-4
// w/scales/biases, 5 count, 6 blocks, 7 act, 8 y. Grid: threadgroups (ceil(D / TN), max_blocks),
// 128 threads; tiling, staging, variants and accumulation as moe_gemm_gate_up with one weight
// tile. Threadgroup memory: argument 0 32 * 32 floats, argument 1 TN * 32 floats.
template <typename W, int TN>
TKERNEL void moe_gemm_down(constant MoeParams& p [[buffer(0)]], constant MatrixDesc& m [[buffer(1)]],
                           device const uchar* w [[buffer(2)]], device const uchar* scales [[buffer(3)]],
                           device const uchar* biases [[buffer(4)]], device const uint* count [[buffer(5)]],
                           device const uint* blocks [[buffer(6)]], device const float* act [[buffer(7)]],
                           device float* y [[buffer(8)]],
                           threadgroup float* xs [[threadgroup(0)]],  // [token][k]
                           threadgroup float* ws [[threadgroup(1)]],  // [row][k] dequantized, then the output tile
                           uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int NB = TN / 16;
  if (tg.y >= count[0]) return;  // whole threadgroup
  device const uint* blk = blocks + 4 * tg.y;
  const uint e = blk[0], r0 = blk[1], nr = blk[2];
  const W wr = W::make(w, scales, biases, m);
  const uint K = m.cols, N = m.rows, n0 = tg.x * TN;
  const uint st = (sg / 2) * 16, sn = (sg % 2) * (TN / 2);
  const uint lr = tid / 4, lc = (tid % 4) * 8;
  const bool has_x = lr < nr;
  device const float* xr = act + (ulong)(r0 + (has_x ? lr : 0)) * K;
  const uint row = e * m.expert_stride + m.row_offset + n0;
  simdgroup_float8x8 acc[2][NB];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k0 = 0; k0 < K; k0 += MOE_TILE) {
    const uint j = k0 + lc;
    moe_stage_x8(xr, has_x, j, K, xs + lr * MOE_TILE + lc);
    for (uint rr = lr; rr < (uint)TN; rr += MOE_TILE)
      moe_stage_w8(wr, row + rr, n0 + rr < N, j, K, ws + rr * MOE_TILE + lc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < MOE_TILE; kk += 8) {
      simdgroup_float8x8 a[2], b[NB];
      for (uint i = 0; i < 2; ++i) simdgroup_load(a[i], xs + (st + 8 * i) * MOE_TILE + kk, MOE_TILE);
      for (uint i = 0; i < (uint)NB; ++i)
        simdgroup_load(b[i], ws + (sn + 8 * i) * MOE_TILE + kk, MOE_TILE, ulong2(0, 0), true);
      for (int i = 0; i < 2; ++i)
        for (int jj = 0; jj < NB; ++jj) simdgroup_multiply_accumulate(acc[i][jj], a[i], b[jj], acc[i][jj]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < 2; ++i)
    for (uint jj = 0; jj < (uint)NB; ++jj) simdgroup_store(acc[i][jj], ws + (st + 8 * i) * TN + sn + 8 * jj, TN);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint q = tid; q < MOE_TILE * (uint)TN; q += 128) {
    const uint i = q / TN, n = n0 + q % TN;
    if (i < nr && n < N) y[(ulong)(r0 + i) * N + n] = ws[q];
  }
}

// moe_combine_sorted: out [T, D] = sum_k weights[t, k] * y[pos[t*K + k], :] (k ascending, f32;
// the same order as moe_combine, so the result does not depend on the sort). Bindings:
// 0 MoeParams, 1 RowsParams (T, D), 2 weights [T, K], 3 pos [T*K], 4 y [T*K, D] sorted, 5 out.
// Grid: dispatchThreads (D, T).
kernel void moe_combine_sorted_f32(constant MoeParams& p [[buffer(0)]], constant RowsParams& rp [[buffer(1)]],
                                   device const float* weights [[buffer(2)]], device const uint* pos [[buffer(3)]],
                                   device const float* y [[buffer(4)]], device float* out [[buffer(5)]],
                                   uint2 gid [[thread_position_in_grid]]) {
  if (gid.x >= rp.dim || gid.y >= rp.tokens) return;
  const uint t = gid.y, K = p.top_k, rows = rp.tokens * K;
  float acc = 0.0f;
  for (uint k = 0; k < K; ++k) {
    const uint r = pos[t * K + k];
    if (r < rows) acc += weights[t * K + k] * y[(ulong)r * rp.dim + gid.x];
  }
  out[(ulong)t * rp.dim + gid.x] = acc;
}

#define MOE(sfx)                                                            \
  INSTANTIATE(moe_router_##sfx##_r2, moe_router, W_##sfx, 2)                \
  INSTANTIATE(moe_router_##sfx##_r4, moe_router, W_##sfx, 4)                \
  INSTANTIATE(moe_gate_up_##sfx##_r2, moe_gate_up, W_##sfx, 2)              \
  INSTANTIATE(moe_gate_up_##sfx##_r4, moe_gate_up, W_##sfx, 4)              \
  INSTANTIATE(gate_up_swiglu_##sfx##_r2, gate_up_swiglu, W_##sfx, 2)        \
  INSTANTIATE(gate_up_swiglu_##sfx##_r4, gate_up_swiglu, W_##sfx, 4)        \
  INSTANTIATE(moe_down_##sfx##_r2, moe_down, W_##sfx, 2)                    \
  INSTANTIATE(moe_down_##sfx##_r4, moe_down, W_##sfx, 4)                    \
  INSTANTIATE(moe_gemm_gate_up_##sfx##_n32, moe_gemm_gate_up, W_##sfx, 32)  \
  INSTANTIATE(moe_gemm_gate_up_##sfx##_n64, moe_gemm_gate_up, W_##sfx, 64)  \
  INSTANTIATE(moe_gemm_down_##sfx##_n32, moe_gemm_down, W_##sfx, 32)        \
  INSTANTIATE(moe_gemm_down_##sfx##_n64, moe_gemm_down, W_##sfx, 64)
FOR_EACH_WEIGHT(MOE)
