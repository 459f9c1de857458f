// Elementwise ops over [T, dim] f32 rows. Grid (ceil(dim / 256), T), 256 threads, one element
// per thread. No reductions.
//   add:              x += y                                  args RowsParams, x (in/out), y
//   swiglu:           out = silu(gate) * up                   args RowsParams, gate, up, out
//   sigmoid_gate_add: out[t, :] += sigmoid(gate[t]) * y[t, :] args RowsParams, y, gate [T], out
#include "common.cuh"

extern "C" __global__ void add(const RowsParams p, float* __restrict__ x, const float* __restrict__ y) {
  const uint j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.dim) return;
  const size_t i = (size_t)blockIdx.y * p.dim + j;
  x[i] = x[i] + y[i];
}

extern "C" __global__ void swiglu(const RowsParams p, const float* __restrict__ gate, const float* __restrict__ up,
                                  float* __restrict__ out) {
  const uint j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.dim) return;
  const size_t i = (size_t)blockIdx.y * p.dim + j;
  out[i] = silu(gate[i]) * up[i];
}

extern "C" __global__ void sigmoid_gate_add(const RowsParams p, const float* __restrict__ y,
                                            const float* __restrict__ gate, float* __restrict__ out) {
  const uint j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.dim) return;
  const size_t i = (size_t)blockIdx.y * p.dim + j;
  out[i] = out[i] + sigmoid(gate[blockIdx.y]) * y[i];
}
