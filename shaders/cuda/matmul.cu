// matmul: out [T, N] = x[x_row0 + t, :K] W^T for W [N, K] in any weight format (common.cuh),
// dequantized in the kernel. Two kernels, chosen by the host on T:
//  - matmul_gemv_<w> (T <= GEMV_TOKENS, decode): f32 throughout;
//  - matmul_mma_<w> (T > GEMV_TOKENS, prefill): bf16 tensor cores, f32 accumulation.
// Arguments (both): MatmulParams p, CudaMatrix m (N = rows, K = cols), w, scales, biases
// (dense formats: any valid pointer), x [*, K] f32, out [T, N] f32.
#include "common.cuh"

// matmul_gemv_<w>: grid (ceil(N / 32), T), 256 threads = 8 warps; warp w of block b owns the
// GEMV_ROWS = 4 output rows (8 b + w) 4 .. + 4 of token blockIdx.y (rows_dot in common.cuh:
// lanes over 16-byte chunks of K, the 4 rows' loads in flight together). A partial last group
// repeats its last row and stores only the valid ones. Accumulation: f32.
#define GEMV_ROWS 4
template <typename W>
__device__ __forceinline__ void matmul_gemv(const MatmulParams p, const CudaMatrix m, const uchar* w,
                                            const uchar* scales, const uchar* biases, const float* __restrict__ x,
                                            float* __restrict__ out) {
  const uint warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = blockIdx.y;
  const uint r0 = (blockIdx.x * 8 + warp) * GEMV_ROWS;
  if (r0 >= m.rows) return;  // whole warp: no collective is left waiting
  const uint nr = min((uint)GEMV_ROWS, m.rows - r0);
  const W wr = make_w<W>(w, scales, biases, m);
  size_t rows[GEMV_ROWS];
  for (uint r = 0; r < GEMV_ROWS; ++r) rows[r] = m.row_offset + r0 + min(r, nr - 1);
  float dots[GEMV_ROWS];
  rows_dot<W, GEMV_ROWS>(wr, rows, m.cols, x + (size_t)(p.x_row0 + t) * m.cols, dots);
  if (lane == 0)
    for (uint r = 0; r < nr; ++r) out[(size_t)t * m.rows + r0 + r] = dots[r];
}

// matmul_gemv_multi_<w>: the GEMV of up to 4 matrices (one weight format, one K) reading the same x,
// in one launch (a layer's input projections: fewer launches per decode step). Arguments:
// MatmulParams p, GemvMulti g, CudaMatrix m0..m3, (w, scales, biases) x 4, x, out0..out3 (unused
// slots: any valid values). Grid (g.ends[g.count - 1], T), 256 threads: block b belongs to the
// first matrix i with b < ends[i] and runs matmul_gemv's body on that matrix's block b - ends[i - 1].
template <typename W>
__device__ __forceinline__ void matmul_gemv_multi(const MatmulParams p, const GemvMulti g, const CudaMatrix* ms,
                                                  const uchar* const* ws, const float* __restrict__ x,
                                                  float* const* outs) {
  uint i = 0;
  while (i + 1 < g.count && blockIdx.x >= g.ends[i]) ++i;
  const uint b = blockIdx.x - (i == 0 ? 0 : g.ends[i - 1]);
  const CudaMatrix m = ms[i];
  const uint warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = blockIdx.y;
  const uint r0 = (b * 8 + warp) * GEMV_ROWS;
  if (r0 >= m.rows) return;  // whole warp
  const uint nr = min((uint)GEMV_ROWS, m.rows - r0);
  const W wr = make_w<W>(ws[3 * i], ws[3 * i + 1], ws[3 * i + 2], m);
  size_t rows[GEMV_ROWS];
  for (uint r = 0; r < GEMV_ROWS; ++r) rows[r] = m.row_offset + r0 + min(r, nr - 1);
  float dots[GEMV_ROWS];
  rows_dot<W, GEMV_ROWS>(wr, rows, m.cols, x + (size_t)(p.x_row0 + t) * m.cols, dots);
  if (lane == 0)
    for (uint r = 0; r < nr; ++r) outs[i][(size_t)t * m.rows + r0 + r] = dots[r];
}

// matmul_mma_<w>: output tiles of 64 tokens x 64 weight rows (mma_tile in common.cuh: bf16 tensor
// cores, f32 accumulation); grid (ceil(N / 64), ceil(T / 64)), 128 threads = 4 warps. Each weight is
// dequantized once per 64 tokens. Tokens past T and rows past N are zero in the tiles and not stored.
template <typename W>
__device__ __forceinline__ void matmul_mma(const MatmulParams p, const CudaMatrix m, const uchar* w,
                                           const uchar* scales, const uchar* biases, const float* __restrict__ x,
                                           float* __restrict__ out) {
  __shared__ __align__(16) ushort xs[MMA_T * MMA_LD];
  __shared__ __align__(16) ushort ws[MMA_N * MMA_LD];
  const W wr = make_w<W>(w, scales, biases, m);
  const uint K = m.cols, N = m.rows, T = p.tokens;
  const uint n0 = blockIdx.x * MMA_N, t0 = blockIdx.y * MMA_T;
  float acc[2][4][4];
  mma_zero(acc);
  auto a_row = [&](uint i) -> const float* {
    return t0 + i < T ? x + (size_t)(p.x_row0 + t0 + i) * K : nullptr;
  };
  mma_tile(wr, (size_t)m.row_offset + n0, min((uint)MMA_N, N - n0), K, a_row, xs, ws, acc);
  mma_store(acc, [&](uint t, uint n, float v) {
    if (t0 + t < T && n0 + n < N) out[(size_t)(t0 + t) * N + n0 + n] = v;
  });
}

#define MATMUL(sfx)                                                                                            \
  extern "C" __global__ void __launch_bounds__(256) matmul_gemv_##sfx(                                         \
      const MatmulParams p, const CudaMatrix m, const uchar* w, const uchar* s, const uchar* b,                \
      const float* __restrict__ x, float* __restrict__ out) {                                                  \
    matmul_gemv<W_##sfx>(p, m, w, s, b, x, out);                                                               \
  }                                                                                                            \
  SIM_EXPORT(matmul_gemv_##sfx)                                                                                \
  extern "C" __global__ void __launch_bounds__(128) matmul_mma_##sfx(                                          \
      const MatmulParams p, const CudaMatrix m, const uchar* w, const uchar* s, const uchar* b,                \
      const float* __restrict__ x, float* __restrict__ out) {                                                  \
    matmul_mma<W_##sfx>(p, m, w, s, b, x, out);                                                                \
  }                                                                                                            \
  SIM_EXPORT(matmul_mma_##sfx)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256) matmul_gemv_multi_##sfx(                                   \
      const MatmulParams p, const GemvMulti g, const CudaMatrix m0, const CudaMatrix m1, const CudaMatrix m2,   \
      const CudaMatrix m3, const uchar* w0, const uchar* s0, const uchar* b0, const uchar* w1, const uchar* s1, \
      const uchar* b1, const uchar* w2, const uchar* s2, const uchar* b2, const uchar* w3, const uchar* s3,      \
      const uchar* b3, const float* __restrict__ x, float* out0, float* out1, float* out2, float* out3) {      \
    const CudaMatrix ms[4] = {m0, m1, m2, m3};                                                                 \
    const uchar* const ws[12] = {w0, s0, b0, w1, s1, b1, w2, s2, b2, w3, s3, b3};                              \
    float* const outs[4] = {out0, out1, out2, out3};                                                           \
    matmul_gemv_multi<W_##sfx>(p, g, ms, ws, x, outs);                                                         \
  }                                                                                                            \
  SIM_EXPORT(matmul_gemv_multi_##sfx)
FOR_EACH_WEIGHT(MATMUL)
