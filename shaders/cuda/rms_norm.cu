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
