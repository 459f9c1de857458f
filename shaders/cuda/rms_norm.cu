// rms_norm / rms_norm_gated: out = x / sqrt(mean(x^2) + eps) * w (* silu(z) for the gated form)
// per row. x, z, out [rows, dim] f32, w [dim] f32.
// Arguments: RmsNormParams p, x, w, out (gated: x, z, w, out). Grid (rows), 256 threads striding
// over dim; sum of squares by warp shuffles then across warps through shared memory (block_sum).
// Accumulation: f32.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) rms_norm(const RmsNormParams p, const float* __restrict__ x,
                                                           const float* __restrict__ w, float* __restrict__ out) {
  __shared__ float partial[32];
  const float* xr = x + (size_t)blockIdx.x * p.dim;
  float ss = 0.0f;
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) ss += xr[i] * xr[i];
  const float inv = rsqrtf(block_sum(ss, partial) / (float)p.dim + p.eps);
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) out[(size_t)blockIdx.x * p.dim + i] = xr[i] * inv * w[i];
}

extern "C" __global__ void __launch_bounds__(256) rms_norm_gated(const RmsNormParams p, const float* __restrict__ x,
                                                                 const float* __restrict__ z,
                                                                 const float* __restrict__ w,
                                                                 float* __restrict__ out) {
  __shared__ float partial[32];
  const float* xr = x + (size_t)blockIdx.x * p.dim;
  float ss = 0.0f;
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) ss += xr[i] * xr[i];
  const float inv = rsqrtf(block_sum(ss, partial) / (float)p.dim + p.eps);
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) {
    const size_t o = (size_t)blockIdx.x * p.dim + i;
    out[o] = xr[i] * inv * w[i] * silu(z[o]);
  }
}

// add_rms_norm: x += y, then out = rms_norm(x, w) (a residual add and the norm after it, one pass).
// add_gated_rms_norm: x += sigmoid(gate[row]) * shared, x += y (that order: the reference's
// sigmoid_gate_add then add), then out = rms_norm(x, w) (the MoE block's end).
// x (in/out), y, shared, out [rows, dim], gate [rows], w [dim] f32. Arguments: RmsNormParams p, x, y,
// (gated: shared, gate,) w, out. Grid (rows), 256 threads striding over dim: each thread writes
// the new x values it owns and reads them back itself after the block sum (no other thread
// touches them). Accumulation: f32.
__device__ __forceinline__ void add_norm_row(const RmsNormParams p, float* x, const float* __restrict__ y,
                                             const float* __restrict__ shared, float g,
                                             const float* __restrict__ w, float* __restrict__ out) {
  __shared__ float partial[32];
  const size_t r0 = (size_t)blockIdx.x * p.dim;
  float ss = 0.0f;
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) {
    float v = x[r0 + i];
    if (shared) v = v + g * shared[r0 + i];
    v = v + y[r0 + i];
    x[r0 + i] = v;
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, partial) / (float)p.dim + p.eps);
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) out[r0 + i] = x[r0 + i] * inv * w[i];
}

extern "C" __global__ void __launch_bounds__(256) add_rms_norm(const RmsNormParams p, float* x,
                                                               const float* __restrict__ y,
                                                               const float* __restrict__ w,
                                                               float* __restrict__ out) {
  add_norm_row(p, x, y, nullptr, 0.0f, w, out);
}

extern "C" __global__ void __launch_bounds__(256) add_gated_rms_norm(const RmsNormParams p, float* x,
                                                                     const float* __restrict__ y,
                                                                     const float* __restrict__ shared,
                                                                     const float* __restrict__ gate,
                                                                     const float* __restrict__ w,
                                                                     float* __restrict__ out) {
  add_norm_row(p, x, y, shared, sigmoid(gate[blockIdx.x]), w, out);
}
