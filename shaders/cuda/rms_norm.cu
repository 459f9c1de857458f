// rms_norm / rms_norm_gated: out = x / sqrt(mean(x^2) + eps) * w (* silu(z) for the gated form)
// per row. x, z, out [rows, dim] f32, w [dim] f32.
// Arguments: RmsNormParams p, x, w, out (gated: x, z, w, out). Grid (rows), 256 threads.
// A row of up to NORM_V * 4 * 256 = 2048 values whose pointers are 16-byte aligned and dim % 4 == 0
// (the model's rows) is held in registers: thread i loads float4 pieces i, i + 256 of every input
// at once (one round trip, not one per value), squares summed by warp shuffles then across the
// warps through shared memory (block_sum), the outputs computed from the registers. Other rows
// stride over dim value by value. Accumulation: f32.
#include "common.cuh"

#define NORM_V 2  // float4 pieces a thread holds

__device__ __forceinline__ bool aligned16(const void* p) { return ((size_t)p & 15) == 0; }
__device__ __forceinline__ void store_f4(float* p, float4 v) {
#if defined(LILY_CUDA_SIM)
  memcpy(p, &v, 16);
#else
  *reinterpret_cast<float4*>(p) = v;
#endif
}
__device__ __forceinline__ float sq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }
// Whether this block's row takes the register path (every pointer given must be 16-byte aligned).
__device__ __forceinline__ bool norm_in_registers(const RmsNormParams p, const void* a, const void* b, const void* c,
                                                  const void* d) {
  return p.dim % 4 == 0 && p.dim <= NORM_V * 4 * blockDim.x && aligned16(a) && aligned16(b) && aligned16(c) &&
         aligned16(d);
}

// GATED: times silu(z).
template <bool GATED>
__device__ __forceinline__ void norm_row(const RmsNormParams p, const float* __restrict__ x,
                                         const float* __restrict__ z, const float* __restrict__ w,
                                         float* __restrict__ out) {
  __shared__ float partial[32];
  const size_t r0 = (size_t)blockIdx.x * p.dim;
  const float* xr = x + r0;
  if (norm_in_registers(p, x, GATED ? z : x, w, out)) {
    float4 v[NORM_V], wv[NORM_V], zv[NORM_V];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_V; ++j) {
      const uint i = 4 * (threadIdx.x + j * blockDim.x);
      if (i < p.dim) {
        v[j] = load_f4(xr + i);
        wv[j] = load_f4(w + i);
        if (GATED) zv[j] = load_f4(z + r0 + i);
      }
    }
#pragma unroll
    for (int j = 0; j < NORM_V; ++j)
      if (4 * (threadIdx.x + j * blockDim.x) < p.dim) ss += sq4(v[j]);
    const float inv = rsqrtf(block_sum(ss, partial) / (float)p.dim + p.eps);
#pragma unroll
    for (int j = 0; j < NORM_V; ++j) {
      const uint i = 4 * (threadIdx.x + j * blockDim.x);
      if (i < p.dim) {
        float4 o = make_float4(v[j].x * inv * wv[j].x, v[j].y * inv * wv[j].y, v[j].z * inv * wv[j].z,
                               v[j].w * inv * wv[j].w);
        if (GATED) o = make_float4(o.x * silu(zv[j].x), o.y * silu(zv[j].y), o.z * silu(zv[j].z), o.w * silu(zv[j].w));
        store_f4(out + r0 + i, o);
      }
    }
    return;
  }
  float ss = 0.0f;
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) ss += xr[i] * xr[i];
  const float inv = rsqrtf(block_sum(ss, partial) / (float)p.dim + p.eps);
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) {
    const float o = xr[i] * inv * w[i];
    out[r0 + i] = GATED ? o * silu(z[r0 + i]) : o;
  }
}

extern "C" __global__ void __launch_bounds__(256) rms_norm(const RmsNormParams p, const float* __restrict__ x,
                                                           const float* __restrict__ w, float* __restrict__ out) {
  kernel_start();
  norm_row<false>(p, x, nullptr, w, out);
}

extern "C" __global__ void __launch_bounds__(256) rms_norm_gated(const RmsNormParams p, const float* __restrict__ x,
                                                                 const float* __restrict__ z,
                                                                 const float* __restrict__ w,
                                                                 float* __restrict__ out) {
  kernel_start();
  norm_row<true>(p, x, z, w, out);
}

// add_rms_norm: x += y, then out = rms_norm(x, w) (a residual add and the norm after it, one pass).
// add_gated_rms_norm: x += sigmoid(gate[row]) * shared, x += y (that order: the reference's
// sigmoid_gate_add then add), then out = rms_norm(x, w) (the MoE block's end).
// x (in/out), y, shared, out [rows, dim], gate [rows], w [dim] f32. Arguments: RmsNormParams p, x, y,
// (gated: shared, gate,) w, out. Grid (rows), 256 threads; the register path as rms_norm's (all of
// x, y, shared and w loaded at once, the new x stored and kept in registers for the output); else
// striding over dim, each thread writing the new x values it owns and reading them back itself
// after the block sum (no other thread touches them). Accumulation: f32.
__device__ __forceinline__ void add_norm_row(const RmsNormParams p, float* x, const float* __restrict__ y,
                                             const float* __restrict__ shared, float g,
                                             const float* __restrict__ w, float* __restrict__ out) {
  __shared__ float partial[32];
  const size_t r0 = (size_t)blockIdx.x * p.dim;
  if (norm_in_registers(p, x, y, shared ? shared : y, w) && aligned16(out)) {
    float4 v[NORM_V], yv[NORM_V], sv[NORM_V], wv[NORM_V];
#pragma unroll
    for (int j = 0; j < NORM_V; ++j) {
      const uint i = 4 * (threadIdx.x + j * blockDim.x);
      if (i < p.dim) {
        v[j] = load_f4(x + r0 + i);
        yv[j] = load_f4(y + r0 + i);
        if (shared) sv[j] = load_f4(shared + r0 + i);
        wv[j] = load_f4(w + i);
      }
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_V; ++j) {
      const uint i = 4 * (threadIdx.x + j * blockDim.x);
      if (i < p.dim) {
        float4 a = v[j];
        if (shared) a = make_float4(a.x + g * sv[j].x, a.y + g * sv[j].y, a.z + g * sv[j].z, a.w + g * sv[j].w);
        a = make_float4(a.x + yv[j].x, a.y + yv[j].y, a.z + yv[j].z, a.w + yv[j].w);
        v[j] = a;
        store_f4(x + r0 + i, a);
        ss += sq4(a);
      }
    }
    const float inv = rsqrtf(block_sum(ss, partial) / (float)p.dim + p.eps);
#pragma unroll
    for (int j = 0; j < NORM_V; ++j) {
      const uint i = 4 * (threadIdx.x + j * blockDim.x);
      if (i < p.dim)
        store_f4(out + r0 + i, make_float4(v[j].x * inv * wv[j].x, v[j].y * inv * wv[j].y, v[j].z * inv * wv[j].z,
                                           v[j].w * inv * wv[j].w));
    }
    return;
  }
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
  kernel_start();
  add_norm_row(p, x, y, nullptr, 0.0f, w, out);
}

extern "C" __global__ void __launch_bounds__(256) add_gated_rms_norm(const RmsNormParams p, float* x,
                                                                     const float* __restrict__ y,
                                                                     const float* __restrict__ shared,
                                                                     const float* __restrict__ gate,
                                                                     const float* __restrict__ w,
                                                                     float* __restrict__ out) {
  kernel_start();
  add_norm_row(p, x, y, shared, sigmoid(gate[blockIdx.x]), w, out);
}

// moe_experts_add_rms_norm: the MoE block's end after its per-pair expert GEMVs (moe_gate_up,
// moe_down: y [T*K, D], the expert output of pair t*K + k), moe_combine and add_gated_rms_norm in
// one launch: x += sigmoid(gate[row]) * shared, x += sum_k weights[row, k] * y[row*K + k] (k
// ascending from 0, summed apart first: the order of moe_combine then add_gated_rms_norm, so the
// result is theirs), then out = rms_norm(x, w). The routed [T, D] sum is never written and read back.
// x (in/out), out [rows, dim]; y [rows*KP, dim]; weights [rows, K]; gate [rows]; w [dim] f32; row r's
// K expert rows at y + r y_stride (y_stride = KP dim), its shared expert row at shared + r shared_stride:
// KP = K and a [rows, dim] shared (stride dim), or KP = K + 1 when the shared expert ran as each row's
// last pair (moe_gate_up / moe_down with MoeShared): shared = y + K dim, stride (K + 1) dim. (The strides
// are u64 arguments: computed in the kernel from a u32 KP, ptxas sm_90 spilled 16 bytes.)
// Arguments: RmsNormParams p, MoeParams mp (top_k K), u64 y_stride, weights, y, x, shared, u64
// shared_stride, gate, w, out.
// Grid (rows), 256 threads; the register path as add_gated_rms_norm's (thread i owns float4 pieces
// i, i + 256 of the row: the K expert rows' pieces summed (routed4), x and shared loaded once, the
// new x kept in registers for the output, w loaded after the block sum); else striding over dim, each
// thread reading back the new x values it wrote itself. Accumulation: f32.
// The expert rows' loads go out ROUTED_BATCH rows at a time for both pieces before any is summed:
// one L2 round trip a batch. (A loop of one load and one sum per row waited one round trip per
// row and piece: 16 at K = 8, 8.4 us of the launch on the H200, Nsight Compute 08:42.)
#define ROUTED_BATCH 8
// r[j] = sum_k wr[k] * y[k * dim + i_j .. + 4] (k ascending) for this thread's NORM_V pieces i_j
// (4 (threadIdx.x + j blockDim.x), those < dim).
__device__ __forceinline__ void routed4(const float* __restrict__ wr, const float* __restrict__ y, uint K, uint dim,
                                        float4* r) {
#pragma unroll
  for (int j = 0; j < NORM_V; ++j) r[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (uint k0 = 0; k0 < K; k0 += ROUTED_BATCH) {
    float c[ROUTED_BATCH];
    float4 e[NORM_V][ROUTED_BATCH];
#pragma unroll
    for (int b = 0; b < ROUTED_BATCH; ++b) {
      const uint k = k0 + b;
      c[b] = k < K ? wr[k] : 0.0f;
#pragma unroll
      for (int j = 0; j < NORM_V; ++j) {
        const uint i = 4 * (threadIdx.x + j * blockDim.x);
        e[j][b] = k < K && i < dim ? load_f4(y + (size_t)k * dim + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
#pragma unroll
    for (int b = 0; b < ROUTED_BATCH; ++b)
      if (k0 + b < K)
#pragma unroll
        for (int j = 0; j < NORM_V; ++j)
          r[j] = make_float4(r[j].x + c[b] * e[j][b].x, r[j].y + c[b] * e[j][b].y, r[j].z + c[b] * e[j][b].z,
                             r[j].w + c[b] * e[j][b].w);
  }
}

extern "C" __global__ void __launch_bounds__(256) moe_experts_add_rms_norm(const RmsNormParams p, const MoeParams mp,
                                                                           const u64 y_stride,
                                                                           const float* __restrict__ weights,
                                                                           const float* __restrict__ y, float* x,
                                                                           const float* __restrict__ shared,
                                                                           const u64 shared_stride,
                                                                           const float* __restrict__ gate,
                                                                           const float* __restrict__ w,
                                                                           float* __restrict__ out) {
  kernel_start();
  __shared__ float partial[32];
  const uint K = mp.top_k;
  const size_t r0 = (size_t)blockIdx.x * p.dim;
  const float* __restrict__ wr = weights + (size_t)blockIdx.x * K;
  const float* __restrict__ yr = y + blockIdx.x * y_stride;
  const float* __restrict__ sr = shared + blockIdx.x * shared_stride;  // the row's shared expert
  const float g = sigmoid(gate[blockIdx.x]);
  if (norm_in_registers(p, x, y, sr, w) && aligned16(out)) {
    float4 v[NORM_V], a[NORM_V], s[NORM_V], r[NORM_V];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_V; ++j) {
      const uint i = 4 * (threadIdx.x + j * blockDim.x);
      if (i < p.dim) a[j] = load_f4(x + r0 + i), s[j] = load_f4(sr + i);
    }
    routed4(wr, yr, K, p.dim, r);
#pragma unroll
    for (int j = 0; j < NORM_V; ++j) {
      const uint i = 4 * (threadIdx.x + j * blockDim.x);
      if (i < p.dim) {
        v[j] = make_float4(a[j].x + g * s[j].x + r[j].x, a[j].y + g * s[j].y + r[j].y, a[j].z + g * s[j].z + r[j].z,
                           a[j].w + g * s[j].w + r[j].w);
        store_f4(x + r0 + i, v[j]);
        ss += sq4(v[j]);
      }
    }
    const float inv = rsqrtf(block_sum(ss, partial) / (float)p.dim + p.eps);
#pragma unroll
    for (int j = 0; j < NORM_V; ++j) {
      const uint i = 4 * (threadIdx.x + j * blockDim.x);
      if (i < p.dim) {
        const float4 wv = load_f4(w + i);
        store_f4(out + r0 + i, make_float4(v[j].x * inv * wv.x, v[j].y * inv * wv.y, v[j].z * inv * wv.z,
                                           v[j].w * inv * wv.w));
      }
    }
    return;
  }
  float ss = 0.0f;
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) {
    float r = 0.0f;
    for (uint k = 0; k < K; ++k) r += wr[k] * yr[(size_t)k * p.dim + i];
    const float v = x[r0 + i] + g * sr[i] + r;
    x[r0 + i] = v;
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, partial) / (float)p.dim + p.eps);
  for (uint i = threadIdx.x; i < p.dim; i += blockDim.x) out[r0 + i] = x[r0 + i] * inv * w[i];
}
