// Elementwise ops over [T, dim] f32 rows. Grid (ceil(dim / 256), T), 256 threads, one element
// per thread. No reductions.
//   add:              x += y                                  args RowsParams, x (in/out), y
//   swiglu:           out = silu(gate) * up                   args RowsParams, gate, up, out
//   sigmoid_gate_add: out[t, :] += sigmoid(gate[t]) * y[t, :] args RowsParams, y, gate [T], out
//   copy_rows:        dst = src                               args RowsParams, src, dst (each already at its
//                     offset: a batched decode moves one sequence's rows in and out of the batch in-stream)
#include "common.cuh"

extern "C" __global__ void add(const RowsParams p, float* __restrict__ x, const float* __restrict__ y) {
  kernel_start();
  const uint j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.dim) return;
  const size_t i = (size_t)blockIdx.y * p.dim + j;
  x[i] = x[i] + y[i];
}

extern "C" __global__ void swiglu(const RowsParams p, const float* __restrict__ gate, const float* __restrict__ up,
                                  float* __restrict__ out) {
  kernel_start();
  const uint j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.dim) return;
  const size_t i = (size_t)blockIdx.y * p.dim + j;
  out[i] = silu(gate[i]) * up[i];
}

extern "C" __global__ void sigmoid_gate_add(const RowsParams p, const float* __restrict__ y,
                                            const float* __restrict__ gate, float* __restrict__ out) {
  kernel_start();
  const uint j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.dim) return;
  const size_t i = (size_t)blockIdx.y * p.dim + j;
  out[i] = out[i] + sigmoid(gate[blockIdx.y]) * y[i];
}

extern "C" __global__ void copy_rows(const RowsParams p, const float* __restrict__ src, float* __restrict__ dst) {
  kernel_start();
  const uint j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.dim) return;
  const size_t i = (size_t)blockIdx.y * p.dim + j;
  dst[i] = src[i];
}

// argmax: out[0] = the index of the largest of x[0..n) (the lowest index among equal values; NaN
// never wins; 0 when no value is larger than -FLT_MAX). Greedy decoding reads this one word instead
// of the logits. Arguments: uint n, x [n] f32, out [1] u32, count [1] u32 (0 between launches),
// parts [2 * gridDim.x] u32. Grid (g <= ARGMAX_BLOCKS), 256 threads: thread i of the grid scans x[i],
// x[i + 256 g], .. keeping its first maximum; a warp and a block reduction on (value, index) keep the
// larger value, then the lower index (the same pair in any order); block b stores its pair at
// parts[2 b] and counts itself (last_block); the last block to count combines the g pairs (read
// through L2: another SM wrote them); last_block sets count back to 0 (graph replays).
// (One block of 1024 threads scanning the 248,320 logits alone took 93 us on the H200, Nsight
// Compute 08:42: the vocabulary projection before it took 191.)
// The pair of (v, j) and (best, bi) that wins: the larger value, then the lower index.
__device__ __forceinline__ void argmax_keep(float v, uint j, float& best, uint& bi) {
  if (v > best || (v == best && j < bi)) {
    best = v;
    bi = j;
  }
}
// The block's winning pair, in thread 0 (reached by every thread).
__device__ __forceinline__ void argmax_block(float& best, uint& bi) {
  __shared__ float wv[32];
  __shared__ uint wi[32];
  for (int o = 16; o > 0; o >>= 1)
    argmax_keep(__shfl_xor_sync(FULL_MASK, best, o), __shfl_xor_sync(FULL_MASK, bi, o), best, bi);
  const uint lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    wv[warp] = best;
    wi[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (uint w = 1; w < blockDim.x / 32; ++w) argmax_keep(wv[w], wi[w], best, bi);
}
extern "C" __global__ void __launch_bounds__(256) argmax(const uint n, const float* __restrict__ x,
                                                         uint* __restrict__ out, uint* count, uint* parts) {
  kernel_start();
  __shared__ uint last[1];
  float best = NEG_BIG;
  uint bi = 0xffffffffu;
  const uint stride = gridDim.x * blockDim.x;
#pragma unroll 4
  for (uint i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) argmax_keep(x[i], i, best, bi);
  argmax_block(best, bi);
  if (threadIdx.x == 0) {
    parts[2 * blockIdx.x] = __float_as_uint(best);
    parts[2 * blockIdx.x + 1] = bi;
  }
  if (!last_block(count, gridDim.x, last)) return;  // whole block
  const volatile uint* vp = parts;
  best = NEG_BIG;
  bi = 0xffffffffu;
  for (uint b = threadIdx.x; b < gridDim.x; b += blockDim.x) argmax_keep(__uint_as_float(vp[2 * b]), vp[2 * b + 1], best, bi);
  argmax_block(best, bi);
  if (threadIdx.x == 0) {
    out[0] = bi < n ? bi : 0u;
  }
}
