// Shared helpers: activation functions, weight readers (dense and MLX affine-quantized), and
// the INSTANTIATE macro that gives each template instance its host name
// `<op>[_<path>]_<weight>[_<tile>]`: `<path>` picks the algorithm (matmul_gemv / matmul_gemm /
// matmul_mma), `<weight>` the weight format (FOR_EACH_WEIGHT), `<tile>` the GPU-family variant of
// the tiling (`r2` / `r4`: rows per simdgroup of a GEMV; `n32` / `n64`: weight rows per
// threadgroup tile of a GEMM; chosen by the host's table in backend/metal/kernels.rs).
// Activations are f32 in device memory; every reduction accumulates in f32.
#pragma once
#include <metal_stdlib>
using namespace metal;
#include "params.h"

// Apple's compiler: an explicit instantiation with a host name. The Linux simulator
// (tools/metal-sim, which does not define __METAL_VERSION__): instantiate and export by name.
// Template kernels are declared `TKERNEL` (C++ for OpenCL, the simulator's second check mode,
// forbids kernel templates, so there they are checked as plain functions).
#if defined(__METAL_VERSION__)
#define INSTANTIATE(name, op, ...) template [[host_name(#name)]] [[kernel]] decltype(op<__VA_ARGS__>) op<__VA_ARGS__>;
#define TKERNEL kernel
#else
#define INSTANTIATE(name, op, ...) MTL_EXPORT_AS(name, op<__VA_ARGS__>)
#if defined(MTL_CLCPP)
#define TKERNEL
#else
#define TKERNEL kernel
#endif
#endif

inline float silu(float x) { return x / (1.0f + metal::precise::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + metal::precise::exp(-x)); }
// log(1 + e^x), linear above 20 like torch.
inline float softplus(float x) { return x > 20.0f ? x : metal::precise::log(1.0f + metal::precise::exp(x)); }

constant constexpr float NEG_BIG = -3.402823466e38f;  // -FLT_MAX: a finite "minus infinity"

// Threadgroup-wide sum / max of one value per thread (every thread gets the result); `partial`
// holds one float per simdgroup. Must be reached by every thread of the threadgroup.
inline float tg_sum(float v, threadgroup float* partial, uint sg, uint lane, uint nsg) {
  v = simd_sum(v);
  if (lane == 0) partial[sg] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float t = lane < nsg ? partial[lane] : 0.0f;
  t = simd_sum(t);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // partial is reused by the caller's next call
  return t;
}

inline float tg_max(float v, threadgroup float* partial, uint sg, uint lane, uint nsg) {
  v = simd_max(v);
  if (lane == 0) partial[sg] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float t = lane < nsg ? partial[lane] : NEG_BIG;
  t = simd_max(t);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return t;
}

// Stored float formats of weights, scales, biases and the KV cache: the type in memory, its
// widening to f32 (exact) and the rounding of an f32 to it (to nearest even). bf16 is handled as
// its 16 bits (the top half of an f32): the `bfloat` type needs Metal Shading Language 3.1
// (macOS 14), and the host compiles these shaders as MSL 3.0 so that macOS 13 runs them
// (backend/metal/kernels.rs: MSL_VERSION).
struct F32 {
  typedef float stored;
  static inline float widen(float v) { return v; }
  static inline float narrow(float v) { return v; }
};
struct F16 {
  typedef half stored;
  static inline float widen(half v) { return float(v); }
  static inline half narrow(float v) { return half(v); }
};
struct BF16 {
  typedef ushort stored;
  static inline float widen(ushort bits) { return as_type<float>(uint(bits) << 16); }
  static inline ushort narrow(float v) {
    uint u = as_type<uint>(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ushort((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return ushort(u >> 16);
  }
};

// Dense weights of stored format T (F32, F16, BF16); row-major [stored rows, cols].
template <typename T> struct DenseW {
  device const typename T::stored* w;
  uint cols;
  static inline DenseW make(device const uchar* w, device const uchar*, device const uchar*, constant MatrixDesc& m) {
    return DenseW{(device const typename T::stored*)w, m.cols};
  }
  // The 8 weights of stored row `row` starting at column j (j + 8 <= cols).
  inline void load8(uint row, uint j, thread float* out) const {
    device const typename T::stored* p = w + (ulong)row * cols + j;
    for (int i = 0; i < 8; ++i) out[i] = T::widen(p[i]);
  }
  inline float at(uint row, uint j) const { return T::widen(w[(ulong)row * cols + j]); }
};

// MLX affine weights: BITS-bit codes packed little-endian in u32 words per row; w = scale * q + bias
// with one scale/bias (stored format S) per `group` consecutive columns. cols % group == 0,
// group % 8 == 0.
template <int BITS, typename S> struct AffineW {
  device const uint* w;
  device const typename S::stored* scales;
  device const typename S::stored* biases;
  uint cols;
  uint group;
  static inline AffineW make(device const uchar* w, device const uchar* s, device const uchar* b, constant MatrixDesc& m) {
    return AffineW{(device const uint*)w, (device const typename S::stored*)s, (device const typename S::stored*)b,
                   m.cols, m.group};
  }
  inline void load8(uint row, uint j, thread float* out) const {
    const uint words_per_row = cols * BITS / 32;
    device const uint* rw = w + (ulong)row * words_per_row;
    const uint g = row * (cols / group) + j / group;
    const float s = S::widen(scales[g]);
    const float b = S::widen(biases[g]);
    const uint mask = (1u << BITS) - 1u;
    for (int i = 0; i < 8; ++i) {
      const uint bit = (j + i) * BITS;
      const uint q = (rw[bit / 32] >> (bit % 32)) & mask;
      out[i] = s * float(q) + b;
    }
  }
  inline float at(uint row, uint j) const {
    const uint words_per_row = cols * BITS / 32;
    const uint bit = j * BITS;
    const uint q = (w[(ulong)row * words_per_row + bit / 32] >> (bit % 32)) & ((1u << BITS) - 1u);
    const uint g = row * (cols / group) + j / group;
    return S::widen(scales[g]) * float(q) + S::widen(biases[g]);
  }
};

// Dot products of R consecutive stored rows row0 .. row0 + R - 1 with x[0..K), each reduced over
// the 32 lanes of one simdgroup (every lane gets every sum): out[r] for r < nr, nr in 1..=R; rows
// past nr repeat row row0 + nr - 1 (loads that hit the cache, no branch in the loop) and their
// sums are not meant to be stored. Lanes take 8 consecutive columns at a time; each x chunk is
// loaded once for the R rows and the R weight loads are independent (more memory requests in
// flight per lane). Row r is summed in the same order whatever R.
// The decode GEMV kernels (matmul_gemv, moe_gate_up, moe_down) instantiate this with
// R = 2 or 4 rows per simdgroup: the `_r2` / `_r4` host-name variants chosen per GPU family.
template <typename W, int R>
inline void rows_dot(thread const W& wr, uint row0, uint nr, uint K, device const float* x, uint lane,
                     thread float* out) {
  uint rows[R];
  for (int r = 0; r < R; ++r) rows[r] = row0 + min((uint)r, nr - 1);
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const uint k8 = K / 8 * 8;
  for (uint j = lane * 8; j < k8; j += 256) {
    float xv[8];
    for (int i = 0; i < 8; ++i) xv[i] = x[j + i];
    for (int r = 0; r < R; ++r) {
      float wv[8];
      wr.load8(rows[r], j, wv);
      float s = 0.0f;
      for (int i = 0; i < 8; ++i) s += wv[i] * xv[i];
      acc[r] += s;
    }
  }
  for (uint j = k8 + lane; j < K; j += 32) {
    const float xj = x[j];
    for (int r = 0; r < R; ++r) acc[r] += wr.at(rows[r], j) * xj;
  }
  for (int r = 0; r < R; ++r) out[r] = simd_sum(acc[r]);
}

// Weight readers by host-name suffix; FOR_EACH_WEIGHT(F) calls F(suffix) for every format
// (a kernel family instantiates itself per format with W_##suffix).
typedef DenseW<F32> W_f32;
typedef DenseW<F16> W_f16;
typedef DenseW<BF16> W_bf16;
typedef AffineW<2, BF16> W_q2_bf16;
typedef AffineW<4, BF16> W_q4_bf16;
typedef AffineW<8, BF16> W_q8_bf16;
typedef AffineW<2, F16> W_q2_f16;
typedef AffineW<4, F16> W_q4_f16;
typedef AffineW<8, F16> W_q8_f16;
typedef AffineW<2, F32> W_q2_f32;
typedef AffineW<4, F32> W_q4_f32;
typedef AffineW<8, F32> W_q8_f32;
#define FOR_EACH_WEIGHT(F) \
  F(f32) F(f16) F(bf16) F(q2_bf16) F(q4_bf16) F(q8_bf16) F(q2_f16) F(q4_f16) F(q8_f16) F(q2_f32) F(q4_f32) F(q8_f32)
