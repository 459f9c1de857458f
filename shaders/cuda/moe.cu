// Mixture of experts: routing on the GPU and the routed experts (only the selected ones are read).
// The expert ids never leave the device: the expert kernels read them, so a layer needs no host
// round trip.
#include "common.cuh"

#define ROUTE_E_MAX 1024
#define ROUTE_K_MAX 64

// Router logit x as a finite value, decided on its bits: NaN and -inf become -FLT_MAX (NaN ranks
// as -inf), +inf becomes FLT_MAX, finite values are unchanged.
__device__ __forceinline__ float route_logit(float x) {
  const uint b = __float_as_uint(x);
  if ((b & 0x7fffffffu) < 0x7f800000u) return x;
  return b == 0x7f800000u ? -NEG_BIG : NEG_BIG;
}
// exp(x - m) for route_logit values x <= m: exactly 0 where it underflows, so x - m never overflows.
__device__ __forceinline__ float route_exp(float x, float m) { return x >= m - 110.0f ? expf(x - m) : 0.0f; }
// The ranking key of an expert with route_logit value x (softmax max m, sum z): the bits of its
// probability p = exp(x - m) / z, plus 1 (so a key is >= 1 until taken, then 0; larger p, larger key).
__device__ __forceinline__ uint route_key(float x, float m, float z) {
  const uint bits = __float_as_uint(route_exp(x, m) / z);
  return (bits >> 31) != 0u ? 1u : min(bits, 0x7f800000u) + 1u;
}

// The routing of one token, run by a whole block: p = softmax(l) over all E experts, top K by p
// (ties: lower id first), weights p / sum(top K p) when renorm != 0, into ids [K] and weights [K].
// The token's logits l [E] are read once (through L2: moe_router's last block reads what the other
// blocks of its grid wrote, never a stale L1 line) into key[], which then holds the
// integer keys: the bits of p + 1, 0 once taken, so the K rounds of the block argmax (warp max, then
// across the warps) always pick K distinct ids < E, the same on every run, whatever the input.
// blockDim.x a multiple of 32 (<= 1024) striding over E (<= 1024); f32 throughout.
__device__ __forceinline__ void route_token(const RouteParams p, const float* l, uint* __restrict__ ids,
                                            float* __restrict__ weights) {
  __shared__ float partial[32];
  __shared__ uint wkey[32];
  __shared__ uint wid[32];
  __shared__ uint key[ROUTE_E_MAX];
  __shared__ float picked_p[ROUTE_K_MAX];
  __shared__ uint picked[ROUTE_K_MAX];
  const uint tid = threadIdx.x, lane = tid % 32, warp = tid / 32, nw = blockDim.x / 32;
  const uint E = min(p.experts, (uint)ROUTE_E_MAX), K = min(p.top_k, min(E, (uint)ROUTE_K_MAX));
  // Each thread reads and rewrites only its own entries e = tid + i blockDim.x of key[].
  float m = NEG_BIG;
  for (uint e = tid; e < E; e += blockDim.x) {
    const float v = route_logit(load_l2(l + e));
    key[e] = __float_as_uint(v);
    m = fmaxf(m, v);
  }
  m = block_max(m, partial);
  float z = 0.0f;
  for (uint e = tid; e < E; e += blockDim.x) z += route_exp(__uint_as_float(key[e]), m);
  z = block_sum(z, partial);  // >= 1: the maximum contributes exp(0)
  for (uint e = tid; e < E; e += blockDim.x) key[e] = route_key(__uint_as_float(key[e]), m, z);
  __syncthreads();
  for (uint k = 0; k < K; ++k) {
    uint best = 0u, best_id = E;
    for (uint e = tid; e < E; e += blockDim.x)
      if (key[e] > best) {
        best = key[e];
        best_id = e;
      }
    uint wbest = best;
    for (int o = 16; o > 0; o >>= 1) wbest = max(wbest, __shfl_xor_sync(FULL_MASK, wbest, o));
    uint cand = best == wbest ? best_id : 0xffffffffu;
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(FULL_MASK, cand, o));
    if (lane == 0) {
      wkey[warp] = wbest;
      wid[warp] = cand;
    }
    __syncthreads();
    if (tid == 0) {
      uint bv = wkey[0], bi = wid[0];
      for (uint w = 1; w < nw; ++w)
        if (wkey[w] > bv || (wkey[w] == bv && wid[w] < bi)) {
          bv = wkey[w];
          bi = wid[w];
        }
      picked[k] = bi;
      picked_p[k] = __uint_as_float(bv - 1u);
      if (bi < E) key[bi] = 0u;  // taken
    }
    __syncthreads();
  }
  if (tid == 0) {
    float sum = 0.0f;
    for (uint k = 0; k < K; ++k) sum += picked_p[k];
    for (uint k = 0; k < K; ++k) {
      ids[k] = picked[k];
      weights[k] = p.renorm != 0 ? picked_p[k] / sum : picked_p[k];
    }
  }
}

// route_token's result for blockDim.x = 32 ROUTE_FAST_K = 256 threads, E <= 256 and K <=
// ROUTE_FAST_K (Qwen3.6: 256 experts, top 8), with no serial step longer than a few instructions:
// - thread e holds expert e: its logit (one load each, through L2), the max (a redux of
//   order-preserving bits a warp, then across the warps) and the softmax sum (a warp sum, then across
//   the warps in warp order), then its key (the block version's: bits of p + 1; 0 past E) in shared
//   memory;
// - warp 0 then selects: lane l takes the keys of experts 8 l .. 8 l + 7 as slots (key << 32 | ~id:
//   larger key first, then the lower id, all distinct), sorts them (Batcher's network of 19
//   compare-exchanges), and five butterfly rounds merge its list with lane l ^ o's (the top 8 of two
//   sorted lists: a bitonic merge), so that every lane holds the top 8 of all E, sorted.
// Same picks in the same order as the block version (the same keys and tie rule), its sum of the K
// picked p in pick order, so its weights; only the softmax denominator's summation order differs (a
// last-bit difference in p). Reached by every thread of the block.
// Why: a clock64 probe of moe_router's last block (H100, 2026-12-07) found the earlier one-warp
// version (8 logits a lane, then K rounds of a lane scan, a redux and a ballot) at ~2.6 us of
// dependent latency: ~190 cycles a logit for the exp and the division, ~230 a round.
#define ROUTE_FAST_K 8
typedef unsigned long long RouteSlot;
__device__ __forceinline__ void route_ce(RouteSlot& a, RouteSlot& b) {  // larger first
  const RouteSlot hi = a > b ? a : b, lo = a > b ? b : a;
  a = hi;
  b = lo;
}
// Order-preserving unsigned bits of a finite float (larger float, larger bits), and back.
__device__ __forceinline__ uint route_ordered(float x) {
  const uint b = __float_as_uint(x);
  return (b >> 31) != 0u ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float route_unordered(uint u) {
  return __uint_as_float((u >> 31) != 0u ? u & 0x7fffffffu : ~u);
}
__device__ __forceinline__ void route_token_fast(const RouteParams p, const float* l, uint* __restrict__ ids,
                                                 float* __restrict__ weights) {
  __shared__ uint wmax[32];
  __shared__ float wsum[32];
  __shared__ uint key[32 * ROUTE_FAST_K];
  const uint e = threadIdx.x, lane = e % 32, warp = e / 32, nw = blockDim.x / 32, E = p.experts;
  const float x = e < E ? route_logit(load_l2(l + e)) : NEG_BIG;
  const uint wm = __reduce_max_sync(FULL_MASK, route_ordered(x));
  if (lane == 0) wmax[warp] = wm;
  __syncthreads();
  uint mo = wmax[0];
  for (uint w = 1; w < nw; ++w) mo = max(mo, wmax[w]);
  const float m = route_unordered(mo);
  const float ws = warp_sum(e < E ? route_exp(x, m) : 0.0f);
  if (lane == 0) wsum[warp] = ws;
  __syncthreads();
  float z = wsum[0];  // >= 1: the maximum contributes exp(0)
  for (uint w = 1; w < nw; ++w) z += wsum[w];
  key[e] = e < E ? route_key(x, m, z) : 0u;  // every slot: blockDim.x = 32 ROUTE_FAST_K
  __syncthreads();
  if (warp != 0) return;
  RouteSlot c[ROUTE_FAST_K];
#pragma unroll
  for (uint i = 0; i < ROUTE_FAST_K; ++i) {
    const uint id = lane * ROUTE_FAST_K + i;
    c[i] = ((RouteSlot)key[id] << 32) | (RouteSlot)(~id);
  }
  static_assert(ROUTE_FAST_K == 8, "the networks below sort 8 slots");
#define ROUTE_CE(a, b) route_ce(c[a], c[b])
  ROUTE_CE(0, 1); ROUTE_CE(2, 3); ROUTE_CE(4, 5); ROUTE_CE(6, 7);
  ROUTE_CE(0, 2); ROUTE_CE(1, 3); ROUTE_CE(4, 6); ROUTE_CE(5, 7);
  ROUTE_CE(1, 2); ROUTE_CE(5, 6);
  ROUTE_CE(0, 4); ROUTE_CE(1, 5); ROUTE_CE(2, 6); ROUTE_CE(3, 7);
  ROUTE_CE(2, 4); ROUTE_CE(3, 5);
  ROUTE_CE(1, 2); ROUTE_CE(3, 4); ROUTE_CE(5, 6);
#pragma unroll 1
  for (uint o = 1; o < 32; o <<= 1) {
    // The top 8 of c and lane ^ o's list (both sorted): max(c[i], d[7 - i]) is bitonic and holds
    // them; three half-cleaner stages sort it.
    RouteSlot d[ROUTE_FAST_K];
#pragma unroll
    for (uint i = 0; i < ROUTE_FAST_K; ++i) d[i] = __shfl_xor_sync(FULL_MASK, c[i], o);
#pragma unroll
    for (uint i = 0; i < ROUTE_FAST_K; ++i) c[i] = c[i] > d[ROUTE_FAST_K - 1 - i] ? c[i] : d[ROUTE_FAST_K - 1 - i];
    ROUTE_CE(0, 4); ROUTE_CE(1, 5); ROUTE_CE(2, 6); ROUTE_CE(3, 7);
    ROUTE_CE(0, 2); ROUTE_CE(1, 3); ROUTE_CE(4, 6); ROUTE_CE(5, 7);
    ROUTE_CE(0, 1); ROUTE_CE(2, 3); ROUTE_CE(4, 5); ROUTE_CE(6, 7);
  }
#undef ROUTE_CE
  // Every lane holds the top 8, sorted: lane k < K writes pick k.
  const uint K = min(p.top_k, E);
  float sum = 0.0f, mine = 0.0f;
  uint id = 0u;
#pragma unroll
  for (uint i = 0; i < ROUTE_FAST_K; ++i) {
    const float pk = __uint_as_float((uint)(c[i] >> 32) - 1u);
    if (i < K) sum += pk;
    if (i == lane) {
      mine = pk;
      id = ~(uint)c[i];
    }
  }
  if (lane < K) {
    ids[lane] = id;
    weights[lane] = p.renorm != 0 ? mine / sum : mine;
  }
}
// route_token_fast where the shapes allow, else route_token. Reached by every thread of the block.
__device__ __forceinline__ void route_token_any(const RouteParams p, const float* l, uint* __restrict__ ids,
                                                float* __restrict__ weights) {
  if (blockDim.x == 32 * ROUTE_FAST_K && p.experts <= blockDim.x && p.top_k <= ROUTE_FAST_K) {
    route_token_fast(p, l, ids, weights);
  } else {
    route_token(p, l, ids, weights);
  }
}

// moe_route: route_token for each token of logits [T, E] into ids [T, K] u32 and weights [T, K].
// Arguments: RouteParams p, logits, ids, weights. Grid (T), 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_route(const RouteParams p, const float* __restrict__ logits,
                                                            uint* __restrict__ ids, float* __restrict__ weights) {
  kernel_start();
  const uint t = blockIdx.x;
  route_token_any(p, logits + (size_t)t * p.experts, ids + (size_t)t * p.top_k, weights + (size_t)t * p.top_k);
}

// moe_router_<w>: the MoE block's routing from its input in one launch (decode: T <= the host's
// GEMV token limit): logits [T, E] = x router^T and shared [T] = x shared_gate^T (router [E, D],
// shared_gate [1, D]: one weight format, one D), then route_token on each token's logits into ids
// [T, K] u32 and weights [T, K] (moe_route's result). Arguments: RouteParams p, GemvMulti g (count 2:
// blocks 0 .. ends[0] - 1 run the router's rows, ends[0] .. ends[1] - 1 the shared gate's one row;
// g.ks warps per row group), CudaMatrix router, CudaMatrix shared_gate, router w / scales / biases,
// shared gate w / scales / biases, x [T, D], logits, shared, counts [T] u32 (0 between launches),
// ids, weights. Grid (ends[1], T), 256 threads: each block runs the staged GEMV (gemv_block, the
// layout of matmul_gemv_multi) on its rows of token blockIdx.y and stores them; then the last block
// of the token to finish (last_block of common.cuh on counts[t], which it sets back to 0 for the
// next launch, graph replays included) reads the token's E logits back and routes them.
// Why many blocks and not one per token: the router is E x D = 256 x 2048 8-bit codes (~0.55 MB with
// scales); one block streams it at one SM's share of the bandwidth, several times slower than the
// GEMV's 16-64 blocks, while the routing tail (route_token_fast: three barriers, then one warp's
// merge) costs the last block ~2.7 us (clock64 probe, H100, 2026-12-07): one launch instead of
// the router GEMV and moe_route.
template <typename W>
__device__ __forceinline__ void moe_router(const RouteParams p, const GemvMulti g, const CudaMatrix rm,
                                           const CudaMatrix sm, const uchar* rw, const uchar* rs, const uchar* rb,
                                           const uchar* sw, const uchar* ss, const uchar* sb,
                                           const float* __restrict__ x, float* logits, float* __restrict__ shared,
                                           uint* __restrict__ counts, uint* __restrict__ ids,
                                           float* __restrict__ weights) {
  __shared__ __align__(16) float4 xs[GEMV_XS / 4];
  __shared__ float part[8][GEMV_ROWS];
  __shared__ uint last[1];
  grid_dep_launch();  // grid_dep_wait(): in gemv_staged, after the first weight loads (x and counts come after it)
  const uint t = blockIdx.y;
  const bool gate = blockIdx.x >= g.ends[0];
  const CudaMatrix m = gate ? sm : rm;
  const W wr = make_w<W>(gate ? sw : rw, gate ? ss : rs, gate ? sb : rb, m);
  gemv_block<W, 2>(wr, m.row_offset, blockIdx.x - (gate ? g.ends[0] : 0u), g.ks, x + (size_t)t * m.cols,
                         gate ? shared + t : logits + (size_t)t * rm.rows, xs, part);
  if (!last_block(&counts[t], gridDim.x, last)) return;  // whole block
  route_token_any(p, logits + (size_t)t * rm.rows, ids + (size_t)t * p.top_k, weights + (size_t)t * p.top_k);
}

// moe_gate_up_<w>: act [T*KP, I], act[t*KP + k, r] = silu(gate_e[r] . x[t]) * (up_e[r] . x[t]),
// e = ids[t*K + k] for k < K; KP = K, or K + 1 with the MoE block's shared expert as each token's
// last pair k = K (its plain gate / up [I, D], the same weight format and group as the experts':
// the host checks; one launch runs the routed and the shared expert's input half). gate / up
// [E, I, D] in one weight format. Arguments: MoeParams p, CudaMatrix gate, CudaMatrix up, gate w /
// scales / biases, up w / scales / biases, uint ks, MoeShared sh (KP and the shared pair's gate /
// up), x [T, D], ids [T*K], act. Grid (ceil(I / (32 / ks)), T*KP), 256 threads = 8 warps in the staged GEMV layout
// of common.cuh (x[t] staged in shared memory; groups of ks warps split D), a group owning the 4 gate
// and the 4 up rows (b (8 / ks) + w / ks) 4 .. + 4 of pair blockIdx.y: each lane's x chunk serves 8
// rows, its 8 independent 16-byte weight loads (and their scales) issued before x is staged
// (gemv_staged, one step ahead). Accumulation: f32. ids == nullptr: expert 0 for every pair
// (gate_up_swiglu's plain matrices).
#define MOE_ROWS 4
// The MoE block's shared expert as the last pair k = K of each token in moe_gate_up / moe_down
// (pairs = K + shared per token; shared = 0: the routed experts alone, the rest unused): its plain
// gate, up [I, D] and down [D, I] descriptors, then their w / scales / biases (MoeShared in args.rs).
struct MoeShared {
  CudaMatrix gm, um, dm;
  uint shared, pad;
  const uchar *gw, *gs, *gb, *uw, *us, *ub, *dw, *ds, *db;
};
static_assert(sizeof(MoeShared) == 176, "MoeShared");
template <typename W>
__device__ __forceinline__ void moe_gate_up(const MoeParams p, const CudaMatrix gm_e, const CudaMatrix um_e,
                                            const uchar* gw, const uchar* gs, const uchar* gb, const uchar* uw,
                                            const uchar* us, const uchar* ub, const uint ks, const MoeShared& sh,
                                            const float* __restrict__ x, const uint* __restrict__ ids,
                                            float* __restrict__ act) {
  __shared__ __align__(16) float4 xs[GEMV_XS / 4];
  __shared__ float part[8][2 * MOE_ROWS];
  const uint warp = threadIdx.x / 32, tk = blockIdx.y, s = warp % ks;
  const uint kp = p.top_k + sh.shared, t = tk / kp, k = tk % kp;
  const bool shared = k == p.top_k;  // whole block: the shared expert's pair
  const CudaMatrix gm = shared ? sh.gm : gm_e, um = shared ? sh.um : um_e;
  const uint r0 = (blockIdx.x * (8 / ks) + warp / ks) * MOE_ROWS;
  const bool active = r0 < gm.rows;  // whole warp
  const uint nr = active ? min((uint)MOE_ROWS, gm.rows - r0) : 1;
  const uint D = gm.cols;
  const uint e = shared || ids == nullptr ? 0u : ids[t * p.top_k + k];
  const W g = shared ? make_w<W>(sh.gw, sh.gs, sh.gb, gm) : make_w<W>(gw, gs, gb, gm);
  const W u = shared ? make_w<W>(sh.uw, sh.us, sh.ub, um) : make_w<W>(uw, us, ub, um);
  size_t grows[MOE_ROWS], urows[MOE_ROWS];
#pragma unroll
  for (uint r = 0; r < MOE_ROWS; ++r) {
    grows[r] = (size_t)e * gm.expert_stride + gm.row_offset + r0 + min(r, nr - 1);
    urows[r] = (size_t)e * um.expert_stride + um.row_offset + r0 + min(r, nr - 1);
  }
  float acc[2 * MOE_ROWS];  // gate sums, then up sums
#pragma unroll
  for (int r = 0; r < 2 * MOE_ROWS; ++r) acc[r] = 0.0f;
  const float* xt = x + (size_t)t * D;
  // Gate rows 0 .. MOE_ROWS - 1, then up rows: 8 weight loads a lane in flight before x is staged.
  // gate and up share one group size (moe_gate_up's host checks one format and shape for both).
  const uint done = gemv_staged<W, 2 * MOE_ROWS, 1>(
      gm, gm.vec && um.vec && gm.group == um.group, D, xt, xs, active, s, ks,
      [&](int r, uint c) { return r < MOE_ROWS ? g.load(grows[r], c) : u.load(urows[r - MOE_ROWS], c); },
      [&](int r, const typename W::Item& it, uint c, const auto& xv) {
        acc[r] += r < MOE_ROWS ? g.dot_x(grows[r], it, c, xv) : u.dot_x(urows[r - MOE_ROWS], it, c, xv);
      });
  if (active && s == 0) {
    rows_dot_tail<W, MOE_ROWS>(g, grows, done, D, xt, acc);
    rows_dot_tail<W, MOE_ROWS>(u, urows, done, D, xt, acc + MOE_ROWS);
  }
  gemv_combine<2 * MOE_ROWS>(acc, part, ks);
  if (active && s == 0 && threadIdx.x % 32 == 0)
    for (uint r = 0; r < nr; ++r) act[(size_t)tk * gm.rows + r0 + r] = silu(acc[r]) * acc[MOE_ROWS + r];
}

// gate_up_swiglu_<w>: out [T, N] = silu(x gate^T) * (x up^T) for one pair of plain matrices gate,
// up [N, K] in one weight format (the MoE block's shared expert: one launch instead of a two-matrix
// GEMV and a swiglu). Arguments: RowsParams p (T, N), CudaMatrix gate, CudaMatrix up, gate w /
// scales / biases, up w / scales / biases, uint ks, x [T, K], out. Grid (ceil(N / (32 / ks)), T),
// 256 threads: moe_gate_up's body (the staged GEMV layout, a warp group owning 4 gate and 4 up
// rows of token blockIdx.y, ks warps splitting K) with one expert and top_k = 1, so pair = token.
template <typename W>
__device__ __forceinline__ void gate_up_swiglu(const RowsParams p, const CudaMatrix gm, const CudaMatrix um,
                                               const uchar* gw, const uchar* gs, const uchar* gb, const uchar* uw,
                                               const uchar* us, const uchar* ub, const uint ks,
                                               const float* __restrict__ x, float* __restrict__ out) {
  MoeParams one;
  one.tokens = p.tokens;
  one.top_k = 1;
  MoeShared none{};
  moe_gate_up<W>(one, gm, um, gw, gs, gb, uw, us, ub, ks, none, x, nullptr, out);
}

// moe_down_<w>: y [T*KP, D], y[tk, r] = down_e[r] . act[tk], down [E, D, I], e = ids[t*K + k] for
// pair tk = t*KP + k, k < K; the shared expert's down [D, I] for k = K (KP = K + sh.shared, as in
// moe_gate_up). Arguments: MoeParams p, CudaMatrix m, w / scales / biases, uint ks, MoeShared sh,
// uint lanes, ids [T*K], act [T*KP, I], y. Grid (ceil(D / (32 / ks * 32 / lanes)), T*KP), 256 threads
// in the staged GEMV layout of common.cuh (gemv_block: act[tk] staged in shared memory, 4 rows a
// lane group, weight loads issued before the staging). lanes = 32, or 8 for short rows (the host's
// gemv_lanes): at I = 512 and 4 bits a row is 16 chunks, which left half of each warp without a
// chunk and took 64 blocks a pair (576 at 9 pairs: 2.2 waves, 11.1 us on the H200); 8 lanes a row
// group give each lane 2 chunks of 4 rows and a block 128 rows. Accumulation: f32.
template <typename W>
__device__ __forceinline__ void moe_down(const MoeParams p, const CudaMatrix m_e, const uchar* w, const uchar* s,
                                         const uchar* b, const uint ks, const uint lanes, const MoeShared& sh,
                                         const uint* __restrict__ ids, const float* __restrict__ act,
                                         float* __restrict__ y) {
  __shared__ __align__(16) float4 xs[GEMV_XS / 4];
  __shared__ float part[32][GEMV_ROWS];
  const uint tk = blockIdx.y, kp = p.top_k + sh.shared, t = tk / kp, k = tk % kp;
  const bool shared = k == p.top_k;  // whole block: the shared expert's pair
  const CudaMatrix m = shared ? sh.dm : m_e;
  // The expert is known before this kernel's grid_dep_wait(): moe_gate_up, the kernel before it,
  // lets it be scheduled only after its own wait, so the router that wrote ids has finished and its
  // writes are visible in L2 (read through it: an earlier layer's ids may sit in this SM's L1). So
  // the expert's weights stream in while moe_gate_up still runs, not after it (gemv_staged issues
  // them, then waits for act).
  const uint e = shared ? 0u : load_l2(ids + t * p.top_k + k);
  const W wr = shared ? make_w<W>(sh.dw, sh.ds, sh.db, m) : make_w<W>(w, s, b, m);
  const size_t base = (size_t)e * m.expert_stride + m.row_offset;
  if (lanes == 8)
    gemv_block<W, 2, 8>(wr, base, blockIdx.x, ks, act + (size_t)tk * m.cols, y + (size_t)tk * m.rows, xs, part);
  else
    gemv_block<W, 2>(wr, base, blockIdx.x, ks, act + (size_t)tk * m.cols, y + (size_t)tk * m.rows, xs, part);
}

// moe_combine: out [T, D] = sum_k weights[t, k] * y[t*K + k, :] (k ascending, f32). Arguments:
// MoeParams p, RowsParams (T, D), weights [T, K], y [T*K, D], out. Grid (ceil(D / 256), T).
extern "C" __global__ void moe_combine(const MoeParams p, const RowsParams rp, const float* __restrict__ weights,
                                       const float* __restrict__ y, float* __restrict__ out) {
  kernel_start();
  const uint j = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y, K = p.top_k;
  if (j >= rp.dim) return;
  float acc = 0.0f;
  for (uint k = 0; k < K; ++k) acc += weights[t * K + k] * y[((size_t)t * K + k) * rp.dim + j];
  out[(size_t)t * rp.dim + j] = acc;
}

// ---- Prefill (T > a threshold): expert-sorted GEMMs on the tensor cores, routed on the GPU --------
// After moe_route (ids [T, K]): moe_sort groups the pairs p = t*K + k by expert and cuts each
// expert's rows into 64-row tiles; moe_gemm_gate_up_<w> computes act = silu(x gate_e^T) * (x up_e^T)
// for each tile of gathered token rows; moe_gemm_down_<w> computes y = act down_e^T; moe_combine_sorted
// sums the K rows of each token in slot order (k ascending, as moe_combine: the result does not
// depend on the order of the rows inside an expert, which moe_sort leaves to its atomics).
// Scratch (u32, the host's): count [4] (count[0] = tiles), tiles [max_tiles, 4] (expert, first
// sorted row, rows <= 64, 0), order [T*K] (sorted row -> p), pos [T*K] (p -> sorted row).

// moe_sort: one block of 1024 threads. Counts the pairs of each expert (shared atomics), the
// exclusive scan of the counts (thread 0; E <= 1024), the tile list (thread 0), then each pair takes
// the next free row of its expert. Arguments: MoeParams p, MoeSortArgs a, ids [T*K], scratch
// (count | tiles | order | pos). Grid (1).
extern "C" __global__ void __launch_bounds__(1024) moe_sort(const MoeParams p, const MoeSortArgs a,
                                                            const uint* __restrict__ ids, uint* __restrict__ scratch) {
  kernel_start();
  __shared__ uint cnt[ROUTE_E_MAX];
  __shared__ uint off[ROUTE_E_MAX];
  const uint pairs = p.tokens * p.top_k, E = min(a.experts, (uint)ROUTE_E_MAX);
  uint* count = scratch;
  uint* tiles = scratch + 4;
  uint* order = tiles + 4 * a.max_tiles;
  uint* pos = order + pairs;
  for (uint e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (uint i = threadIdx.x; i < pairs; i += blockDim.x) atomicAdd(&cnt[min(ids[i], E - 1)], 1u);
  __syncthreads();
  if (threadIdx.x == 0) {
    uint rows = 0, nt = 0;
    for (uint e = 0; e < E; ++e) {
      off[e] = rows;
      for (uint j = 0; j < cnt[e] && nt < a.max_tiles; j += MMA_T, ++nt) {
        tiles[4 * nt] = e;
        tiles[4 * nt + 1] = rows + j;
        tiles[4 * nt + 2] = min((uint)MMA_T, cnt[e] - j);
        tiles[4 * nt + 3] = 0;
      }
      rows += cnt[e];
      cnt[e] = 0;  // reused as the fill count of the scatter
    }
    count[0] = nt;
  }
  __syncthreads();
  for (uint i = threadIdx.x; i < pairs; i += blockDim.x) {
    const uint e = min(ids[i], E - 1);
    const uint row = off[e] + atomicAdd(&cnt[e], 1u);
    order[row] = i;
    pos[i] = row;
  }
}

// moe_gemm_gate_up_<w>: act [T*K, I] in sorted row order, act[row, n] = silu(gate_e[n] . x[t]) *
// (up_e[n] . x[t]) for the rows of one tile (expert e, token t = order[row] / K). Arguments:
// MoeParams p, CudaMatrix gate, CudaMatrix up, gate w / scales / biases, up w / scales / biases,
// x [T, D], scratch (moe_sort's), max_tiles, act. Grid (ceil(I / 64), max_tiles), 256 threads: one
// mma_tile whose 128 columns are gate rows n0 .. n0 + 64 beside up rows n0 .. n0 + 64 (the gathered
// x rows staged once for both); the gate warps (w % 4 < 2) hand their accumulators to the up warps
// through shared memory, which apply silu(g) u and store. Tiles past count[0] return at once.
#define MOE_GATE_LD (MMA_H + 4)  // floats a row of the staged gate values (MMA_T rows fit in MMA_SMEM)
template <typename W>
__device__ __forceinline__ void moe_gemm_gate_up(const MoeParams p, const CudaMatrix gm, const CudaMatrix um,
                                                 const uchar* gw, const uchar* gs, const uchar* gb, const uchar* uw,
                                                 const uchar* us, const uchar* ub, const float* __restrict__ x,
                                                 const uint* __restrict__ scratch, const uint max_tiles,
                                                 float* __restrict__ act) {
  __shared__ __align__(16) ushort smem[MMA_SMEM];
  static_assert(MMA_T * MOE_GATE_LD * 2 <= MMA_SMEM, "gate values fit in the tile's shared memory");
  if (blockIdx.y >= scratch[0]) return;  // whole block
  const uint* tile = scratch + 4 + 4 * blockIdx.y;
  const uint e = tile[0], row0 = tile[1], nrows = tile[2];
  const uint* order = scratch + 4 + 4 * max_tiles;
  const uint D = gm.cols, I = gm.rows, n0 = blockIdx.x * MMA_H;
  auto a_row = [&](uint i) -> const float* {
    return i < nrows ? x + (size_t)(order[row0 + i] / p.top_k) * D : nullptr;
  };
  const uint nv = min((uint)MMA_H, I - n0);
  float acc[2][4][4];
  mma_zero(acc);
  mma_tile(make_w<W>(gw, gs, gb, gm), (size_t)e * gm.expert_stride + gm.row_offset + n0, nv,
           make_w<W>(uw, us, ub, um), (size_t)e * um.expert_stride + um.row_offset + n0, nv, D, a_row, smem, acc);
  float* gate = reinterpret_cast<float*>(smem);  // [MMA_T][MOE_GATE_LD]; mma_tile ended with a barrier
  const bool up = (threadIdx.x / 32) % 4 >= 2;
  if (!up) mma_store(acc, [&](uint r, uint n, float v) { gate[r * MOE_GATE_LD + n] = v; });
  __syncthreads();
  if (up)
    mma_store(acc, [&](uint r, uint n, float v) {
      n -= MMA_H;
      if (r < nrows && n < nv) act[(size_t)(row0 + r) * I + n0 + n] = silu(gate[r * MOE_GATE_LD + n]) * v;
    });
}

// moe_gemm_down_<w>: y [T*K, D] in sorted row order, y[row, n] = down_e[n] . act[row] for the rows of
// one tile. Arguments: MoeParams p, CudaMatrix down, w / scales / biases, scratch, max_tiles, act, y.
// Grid (ceil(D / 128), max_tiles), 256 threads (mma_tile over 128 consecutive rows of down_e).
template <typename W>
__device__ __forceinline__ void moe_gemm_down(const MoeParams p, const CudaMatrix m, const uchar* w, const uchar* s,
                                              const uchar* b, const uint* __restrict__ scratch, const uint max_tiles,
                                              const float* __restrict__ act, float* __restrict__ y) {
  __shared__ __align__(16) ushort smem[MMA_SMEM];
  (void)p;
  (void)max_tiles;
  if (blockIdx.y >= scratch[0]) return;  // whole block
  const uint* tile = scratch + 4 + 4 * blockIdx.y;
  const uint e = tile[0], row0 = tile[1], nrows = tile[2];
  const uint I = m.cols, D = m.rows, n0 = blockIdx.x * MMA_N;
  auto a_row = [&](uint i) -> const float* { return i < nrows ? act + (size_t)(row0 + i) * I : nullptr; };
  const uint nv = min((uint)MMA_N, D - n0);
  const W wr = make_w<W>(w, s, b, m);
  const size_t wrow0 = (size_t)e * m.expert_stride + m.row_offset + n0;
  float acc[2][4][4];
  mma_zero(acc);
  mma_tile(wr, wrow0, min(nv, (uint)MMA_H), wr, wrow0 + MMA_H, nv > MMA_H ? nv - MMA_H : 0u, I, a_row, smem, acc);
  mma_store(acc, [&](uint r, uint n, float v) {
    if (r < nrows && n < nv) y[(size_t)(row0 + r) * D + n0 + n] = v;
  });
}

// moe_combine_sorted: out [T, D] = sum_k weights[t, k] * y[pos[t*K + k], :] (k ascending, f32).
// Arguments: MoeParams p, RowsParams (T, D), weights [T, K], scratch (pos at its offset), max_tiles,
// y [T*K, D] sorted, out. Grid (ceil(D / 256), T).
extern "C" __global__ void moe_combine_sorted(const MoeParams p, const RowsParams rp, const float* __restrict__ weights,
                                              const uint* __restrict__ scratch, const uint max_tiles,
                                              const float* __restrict__ y, float* __restrict__ out) {
  kernel_start();
  const uint j = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y, K = p.top_k;
  if (j >= rp.dim) return;
  const uint pairs = rp.tokens * K;
  const uint* pos = scratch + 4 + 4 * max_tiles + pairs;
  float acc = 0.0f;
  for (uint k = 0; k < K; ++k) acc += weights[t * K + k] * y[(size_t)pos[t * K + k] * rp.dim + j];
  out[(size_t)t * rp.dim + j] = acc;
}

#define MOE_ROUTER(sfx)                                                                                    \
  extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS(W_##sfx)) moe_router_##sfx(                  \
      const RouteParams p, const GemvMulti g, const CudaMatrix rm, const CudaMatrix sm, const uchar* rw,        \
      const uchar* rs, const uchar* rb, const uchar* sw, const uchar* ss, const uchar* sb,                      \
      const float* __restrict__ x, float* logits, float* __restrict__ shared, uint* __restrict__ counts,        \
      uint* __restrict__ ids, float* __restrict__ weights) {                                                    \
    moe_router<W_##sfx>(p, g, rm, sm, rw, rs, rb, sw, ss, sb, x, logits, shared, counts, ids, weights);        \
  }                                                                                                            \
  SIM_EXPORT(moe_router_##sfx)
FOR_EACH_WEIGHT(MOE_ROUTER)

#define MOE(sfx)                                                                                                 \
  extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS(W_##sfx)) moe_gate_up_##sfx(                                           \
      const MoeParams p, const CudaMatrix gm, const CudaMatrix um, const uchar* gw, const uchar* gs,             \
      const uchar* gb, const uchar* uw, const uchar* us, const uchar* ub, const uint ks, const MoeShared sh,     \
      const float* __restrict__ x, const uint* __restrict__ ids, float* __restrict__ act) {                     \
    grid_dep_wait(); /* then launch moe_down, which reads the ids before its own wait (moe_down) */ \
    grid_dep_launch(); \
    moe_gate_up<W_##sfx>(p, gm, um, gw, gs, gb, uw, us, ub, ks, sh, x, ids, act);                                    \
  }                                                                                                              \
  SIM_EXPORT(moe_gate_up_##sfx)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS(W_##sfx)) moe_down_##sfx(                                              \
      const MoeParams p, const CudaMatrix m, const uchar* w, const uchar* s, const uchar* b, const uint ks,      \
      const uint lanes, const MoeShared sh, const uint* __restrict__ ids, const float* __restrict__ act, float* __restrict__ y) {  \
    grid_dep_launch(); /* grid_dep_wait(): in gemv_staged, after the first weight loads (moe_down) */ \
    moe_down<W_##sfx>(p, m, w, s, b, ks, lanes, sh, ids, act, y);                                                           \
  }                                                                                                              \
  SIM_EXPORT(moe_down_##sfx)                                                                                     \
  extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS(W_##sfx)) moe_gemm_gate_up_##sfx(                                      \
      const MoeParams p, const CudaMatrix gm, const CudaMatrix um, const uchar* gw, const uchar* gs,             \
      const uchar* gb, const uchar* uw, const uchar* us, const uchar* ub, const float* __restrict__ x,            \
      const uint* __restrict__ scratch, const uint max_tiles, float* __restrict__ act) {                         \
    kernel_start(); \
    moe_gemm_gate_up<W_##sfx>(p, gm, um, gw, gs, gb, uw, us, ub, x, scratch, max_tiles, act);                    \
  }                                                                                                              \
  SIM_EXPORT(moe_gemm_gate_up_##sfx)                                                                             \
  extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS(W_##sfx)) moe_gemm_down_##sfx(                                         \
      const MoeParams p, const CudaMatrix m, const uchar* w, const uchar* s, const uchar* b,                     \
      const uint* __restrict__ scratch, const uint max_tiles, const float* __restrict__ act,                     \
      float* __restrict__ y) {                                                                                   \
    kernel_start(); \
    moe_gemm_down<W_##sfx>(p, m, w, s, b, scratch, max_tiles, act, y);                                           \
  }                                                                                                              \
  SIM_EXPORT(moe_gemm_down_##sfx)
FOR_EACH_WEIGHT(MOE)

// One block per SM asked for (not GEMV_MIN_BLOCKS): with one expert and top_k = 1 folded in, the
// compiler keeps more loads in flight and at 128 registers the 4-bit kernels spilled (88 bytes; the
// H200 measured 14.7 us a launch against 12.8 for the two-matrix GEMV + swiglu it replaces). Its grid
// is small (the shared expert: 512 rows, 16-32 blocks on 132 SMs), so the occupancy cap costs nothing.
#define GATE_UP_SWIGLU(sfx)                                                                                        \
  extern "C" __global__ void __launch_bounds__(256, 1) gate_up_swiglu_##sfx(                                       \
      const RowsParams p, const CudaMatrix gm, const CudaMatrix um, const uchar* gw, const uchar* gs,              \
      const uchar* gb, const uchar* uw, const uchar* us, const uchar* ub, const uint ks,                           \
      const float* __restrict__ x, float* __restrict__ out) {                                                      \
    grid_dep_launch(); /* grid_dep_wait(): in gemv_staged, after the first weight loads */ \
    gate_up_swiglu<W_##sfx>(p, gm, um, gw, gs, gb, uw, us, ub, ks, x, out);                                        \
  }                                                                                                                \
  SIM_EXPORT(gate_up_swiglu_##sfx)
FOR_EACH_WEIGHT(GATE_UP_SWIGLU)
