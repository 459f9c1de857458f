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

// moe_route: per token, p = softmax(logits) over all E experts, top K by p (ties: lower id
// first), weights p / sum(top K p) when renorm != 0. logits [T, E], ids [T, K] u32, weights
// [T, K]. Arguments: RouteParams p, logits, ids, weights. Grid (T), 256 threads striding over E
// (<= 1024); the K rounds of a block argmax run on integer keys (the bits of p + 1, 0 once taken:
// always K distinct ids < E, the same on every run, whatever the input), warp max then across the
// warps. f32 throughout.
extern "C" __global__ void __launch_bounds__(256) moe_route(const RouteParams p, const float* __restrict__ logits,
                                                            uint* __restrict__ ids, float* __restrict__ weights) {
  __shared__ float partial[32];
  __shared__ uint wkey[32];
  __shared__ uint wid[32];
  __shared__ uint key[ROUTE_E_MAX];
  __shared__ float picked_p[ROUTE_K_MAX];
  __shared__ uint picked[ROUTE_K_MAX];
  const uint t = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32, nw = blockDim.x / 32;
  const uint E = min(p.experts, (uint)ROUTE_E_MAX), K = min(p.top_k, min(E, (uint)ROUTE_K_MAX));
  const float* l = logits + (size_t)t * p.experts;
  float m = NEG_BIG;
  for (uint e = tid; e < E; e += blockDim.x) m = fmaxf(m, route_logit(l[e]));
  m = block_max(m, partial);
  float z = 0.0f;
  for (uint e = tid; e < E; e += blockDim.x) z += route_exp(route_logit(l[e]), m);
  z = block_sum(z, partial);  // >= 1: the maximum contributes exp(0)
  for (uint e = tid; e < E; e += blockDim.x) {
    const uint bits = __float_as_uint(route_exp(route_logit(l[e]), m) / z);
    key[e] = (bits >> 31) != 0u ? 1u : min(bits, 0x7f800000u) + 1u;
  }
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
      ids[(size_t)t * p.top_k + k] = picked[k];
      weights[(size_t)t * p.top_k + k] = p.renorm != 0 ? picked_p[k] / sum : picked_p[k];
    }
  }
}

// moe_gate_up_<w>: act [T*K, I], act[t*K + k, r] = silu(gate_e[r] . x[t]) * (up_e[r] . x[t]),
// e = ids[t*K + k]; gate / up [E, I, D] in one weight format. Arguments: MoeParams p,
// CudaMatrix gate, CudaMatrix up, gate w / scales / biases, up w / scales / biases, x [T, D],
// ids [T*K], act. Grid (ceil(I / 32), T*K), 256 threads = 8 warps; warp w owns the 4 rows
// (8 bx + w) 4 .. + 4 of pair blockIdx.y (rows_dot for the gate rows, then the up rows; lanes over
// 16-byte chunks of D). Accumulation: f32.
#define MOE_ROWS 4
template <typename W>
__device__ __forceinline__ void moe_gate_up(const MoeParams p, const CudaMatrix gm, const CudaMatrix um,
                                            const uchar* gw, const uchar* gs, const uchar* gb, const uchar* uw,
                                            const uchar* us, const uchar* ub, const float* __restrict__ x,
                                            const uint* __restrict__ ids, float* __restrict__ act) {
  const uint warp = threadIdx.x / 32, lane = threadIdx.x % 32, tk = blockIdx.y;
  const uint r0 = (blockIdx.x * 8 + warp) * MOE_ROWS;
  if (r0 >= gm.rows) return;  // whole warp
  const uint nr = min((uint)MOE_ROWS, gm.rows - r0);
  const uint t = tk / p.top_k, D = gm.cols;
  const uint e = ids[tk];
  const W g = make_w<W>(gw, gs, gb, gm);
  const W u = make_w<W>(uw, us, ub, um);
  size_t grows[MOE_ROWS], urows[MOE_ROWS];
  for (uint r = 0; r < MOE_ROWS; ++r) {
    grows[r] = (size_t)e * gm.expert_stride + gm.row_offset + r0 + min(r, nr - 1);
    urows[r] = (size_t)e * um.expert_stride + um.row_offset + r0 + min(r, nr - 1);
  }
  float gv[MOE_ROWS], uv[MOE_ROWS];
  rows_dot<W, MOE_ROWS>(g, grows, D, x + (size_t)t * D, gv);
  rows_dot<W, MOE_ROWS>(u, urows, D, x + (size_t)t * D, uv);
  if (lane == 0)
    for (uint r = 0; r < nr; ++r) act[(size_t)tk * gm.rows + r0 + r] = silu(gv[r]) * uv[r];
}

// moe_down_<w>: y [T*K, D], y[tk, r] = down_e[r] . act[tk], down [E, D, I]. Arguments:
// MoeParams p, CudaMatrix m, w / scales / biases, ids [T*K], act [T*K, I], y. Grid
// (ceil(D / 32), T*K), 256 threads, 4 rows per warp as moe_gate_up. Accumulation: f32.
template <typename W>
__device__ __forceinline__ void moe_down(const MoeParams p, const CudaMatrix m, const uchar* w, const uchar* s,
                                         const uchar* b, const uint* __restrict__ ids, const float* __restrict__ act,
                                         float* __restrict__ y) {
  const uint warp = threadIdx.x / 32, lane = threadIdx.x % 32, tk = blockIdx.y;
  const uint r0 = (blockIdx.x * 8 + warp) * MOE_ROWS;
  if (r0 >= m.rows) return;
  const uint nr = min((uint)MOE_ROWS, m.rows - r0);
  const uint e = ids[tk], I = m.cols;
  const W wr = make_w<W>(w, s, b, m);
  size_t rows[MOE_ROWS];
  for (uint r = 0; r < MOE_ROWS; ++r) rows[r] = (size_t)e * m.expert_stride + m.row_offset + r0 + min(r, nr - 1);
  float v[MOE_ROWS];
  rows_dot<W, MOE_ROWS>(wr, rows, I, act + (size_t)tk * I, v);
  if (lane == 0)
    for (uint r = 0; r < nr; ++r) y[(size_t)tk * m.rows + r0 + r] = v[r];
}

// moe_combine: out [T, D] = sum_k weights[t, k] * y[t*K + k, :] (k ascending, f32). Arguments:
// MoeParams p, RowsParams (T, D), weights [T, K], y [T*K, D], out. Grid (ceil(D / 256), T).
extern "C" __global__ void moe_combine(const MoeParams p, const RowsParams rp, const float* __restrict__ weights,
                                       const float* __restrict__ y, float* __restrict__ out) {
  const uint j = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y, K = p.top_k;
  if (j >= rp.dim) return;
  float acc = 0.0f;
  for (uint k = 0; k < K; ++k) acc += weights[t * K + k] * y[((size_t)t * K + k) * rp.dim + j];
  out[(size_t)t * rp.dim + j] = acc;
}

#define MOE(sfx)                                                                                                 \
  extern "C" __global__ void __launch_bounds__(256) moe_gate_up_##sfx(                                           \
      const MoeParams p, const CudaMatrix gm, const CudaMatrix um, const uchar* gw, const uchar* gs,             \
      const uchar* gb, const uchar* uw, const uchar* us, const uchar* ub, const float* __restrict__ x,            \
      const uint* __restrict__ ids, float* __restrict__ act) {                                                   \
    moe_gate_up<W_##sfx>(p, gm, um, gw, gs, gb, uw, us, ub, x, ids, act);                                        \
  }                                                                                                              \
  SIM_EXPORT(moe_gate_up_##sfx)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) moe_down_##sfx(                                              \
      const MoeParams p, const CudaMatrix m, const uchar* w, const uchar* s, const uchar* b,                     \
      const uint* __restrict__ ids, const float* __restrict__ act, float* __restrict__ y) {                      \
    moe_down<W_##sfx>(p, m, w, s, b, ids, act, y);                                                               \
  }                                                                                                              \
  SIM_EXPORT(moe_down_##sfx)
FOR_EACH_WEIGHT(MOE)
