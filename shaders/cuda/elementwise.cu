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
// of the logits. Arguments: uint n, x [n] f32, out [1] u32. Grid (1), 1024 threads: each scans a
// stride of x keeping its first maximum, then a warp and a block reduction on (value, index).
extern "C" __global__ void __launch_bounds__(1024) argmax(const uint n, const float* __restrict__ x,
                                                          uint* __restrict__ out) {
  kernel_start();
  __shared__ float wv[32];
  __shared__ uint wi[32];
  float best = NEG_BIG;
  uint bi = 0xffffffffu;
  for (uint i = threadIdx.x; i < n; i += blockDim.x)
    if (x[i] > best) {
      best = x[i];
      bi = i;
    }
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(FULL_MASK, best, o);
    const uint j = __shfl_xor_sync(FULL_MASK, bi, o);
    if (v > best || (v == best && j < bi)) {
      best = v;
      bi = j;
    }
  }
  const uint lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    wv[warp] = best;
    wi[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (uint w = 1; w < blockDim.x / 32; ++w)
      if (wv[w] > best || (wv[w] == best && wi[w] < bi)) {
        best = wv[w];
        bi = wi[w];
      }
    out[0] = bi < n ? bi : 0u;
  }
}
