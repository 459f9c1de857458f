// The row norms' shared pieces (rms_norm.cu, and moe.cu's moe_down_add_rms_norm, which ends the MoE
// block in its last block): the register path's helpers and the MoE block's end for one row.
#pragma once
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

// 16 bytes from p through L2 only (ld.global.cg): data other blocks of the same launch wrote
// (moe_down_add_rms_norm's expert rows) must not come from a stale L1 line or the read-only path.
__device__ __forceinline__ float4 load_f4_l2(const float* p) {
#if defined(LILY_CUDA_SIM)
  return load_f4(p);
#else
  return __ldcg(reinterpret_cast<const float4*>(p));
#endif
}

// The MoE block's end after its per-pair expert GEMVs (moe_gate_up,
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
__device__ __forceinline__ void routed4(const float* __restrict__ wr, const float* y, uint K, uint dim,
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
        e[j][b] = k < K && i < dim ? load_f4_l2(y + (size_t)k * dim + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
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

// experts_add_norm_row: that end for row `row` (the kernel's blockIdx.x; moe_down_add_rms_norm's
// token); partial: 32 floats of the caller's shared memory (block_sum; a header declares no
// __shared__ variables: the simulator lowers them in the .cu files only). Reached by every thread.
__device__ __forceinline__ void experts_add_norm_row(const RmsNormParams p, const MoeParams mp, const u64 y_stride,
                                                     const float* __restrict__ weights, const float* y, float* x,
                                                     const float* shared, const u64 shared_stride,
                                                     const float* __restrict__ gate, const float* __restrict__ w,
                                                     float* __restrict__ out, const uint row, float* partial) {
  const uint K = mp.top_k;
  const size_t r0 = (size_t)row * p.dim;
  const float* __restrict__ wr = weights + (size_t)row * K;
  const float* yr = y + row * y_stride;
  const float* sr = shared + row * shared_stride;  // the row's shared expert
  const float g = sigmoid(gate[row]);
  if (norm_in_registers(p, x, y, sr, w) && aligned16(out)) {
    float4 v[NORM_V], a[NORM_V], s[NORM_V], r[NORM_V];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_V; ++j) {
      const uint i = 4 * (threadIdx.x + j * blockDim.x);
      if (i < p.dim) a[j] = load_f4(x + r0 + i), s[j] = load_f4_l2(sr + i);
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
