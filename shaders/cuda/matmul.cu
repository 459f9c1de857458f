// matmul: out [T, N] = x[x_row0 + t, :K] W^T for W [N, K] in any weight format (common.cuh),
// dequantized in the kernel. Two kernels, chosen by the host on T:
//  - matmul_gemv_<w> (T <= GEMV_TOKENS, decode): f32 throughout;
//  - matmul_mma_<w> (T > GEMV_TOKENS, prefill): bf16 tensor cores, f32 accumulation.
// Arguments (both): MatmulParams p, CudaMatrix m (N = rows, K = cols), w, scales, biases
// (dense formats: any valid pointer), [the GEMV only: uint ks, warps per row group], x [*, K] f32,
// out [T, N] f32.
#include "common.cuh"

// matmul_gemv_<w>: grid (g <= ceil(N / (32 / ks)), T), 256 threads = 8 warps (the staged GEMV layout of
// common.cuh: gemv_block): block b runs the row blocks b, b + g, .. of token blockIdx.y; in row block
// rb, warp w owns, with the other ks - 1 warps of its group, the GEMV_ROWS = 4 output rows
// (rb (8 / ks) + w / ks) 4 .. + 4; lane l takes 16-byte chunks l, l + 32, .. of its share of K, loads
// GEMV_NC of them per row ahead (8 loads a lane in flight before x is staged) and multiplies each
// with its x chunk (staged in shared memory): a warp's weight reads are 512 contiguous bytes of a
// row. x is staged once per block when K fits one pass (gemv_one_pass): the host caps g for the
// vocabulary projection (7,760 row blocks at Qwen3.6's shapes, each staging x itself: 191 us on the
// H200, Nsight Compute 08:42, for 286 MB of weights). Accumulation: f32.
#define GEMV_NC 2
// Rows a warp group owns in matmul_gemv_multi (GEMV_ROWS elsewhere): 6 at 4 bits, 12 loads a lane
// in flight, so a layer's input projections take one wave of blocks (DeltaNet's 12,352 rows: 386
// blocks of 32 rows were 1.46 waves of the 264 that fit the H200's SMs, 259 of 48 rows are one).
// The host's copy: GEMV_WIDE_ROWS_Q4 in ops/matmul/cuda.rs. Not for matmul_gemv's looping blocks
// (the vocabulary projection): there the 4-bit instance spilled and took 112.6 us, not 99.4
// (Nsight Compute, H200, 2026-12-02 20:13).
#define GEMV_WIDE_ROWS(W) ((W::EPC) == 32 ? 6 : GEMV_ROWS)
template <typename W>
__device__ __forceinline__ void matmul_gemv(const MatmulParams p, const CudaMatrix m, const uchar* w,
                                            const uchar* scales, const uchar* biases, const uint ks,
                                            const float* __restrict__ x, float* __restrict__ out) {
  __shared__ __align__(16) float4 xs[GEMV_XS / 4];
  __shared__ float part[8][GEMV_ROWS];
  const uint t = blockIdx.y, blocks = (m.rows + 32 / ks - 1) / (32 / ks);
  const W wr = make_w<W>(w, scales, biases, m);
  const bool keep = gemv_one_pass<W>(m);
  for (uint b = blockIdx.x; b < blocks; b += gridDim.x)
    gemv_block<W, GEMV_NC>(wr, m.row_offset, b, ks, x + (size_t)(p.x_row0 + t) * m.cols, out + (size_t)t * m.rows,
                           xs, part, keep && b != blockIdx.x);
}
// matmul_gemv_multi_<w>: the GEMV of up to 4 matrices (one weight format, one K) reading the same x,
// in one launch (a layer's input projections: fewer launches per decode step). Arguments:
// MatmulParams p, GemvMulti g (g.ks: warps per row group), CudaMatrix m0..m3, (w, scales, biases) x 4,
// x, out0..out3 (unused slots: any valid values). Grid (g.ends[g.count - 1], T), 256 threads: block b belongs to the
// first matrix i with b < ends[i] and runs matmul_gemv's body on that matrix's block b - ends[i - 1].
// The matrix is picked by selects, not by indexing an array (which would live in local memory).
template <typename T> __device__ __forceinline__ T pick4(uint i, T a, T b, T c, T d) {
  return i == 0 ? a : i == 1 ? b : i == 2 ? c : d;
}
template <typename W>
__device__ __forceinline__ void matmul_gemv_multi(const MatmulParams p, const GemvMulti g, const CudaMatrix m0,
                                                  const CudaMatrix m1, const CudaMatrix m2, const CudaMatrix m3,
                                                  const uchar* w0, const uchar* s0, const uchar* b0, const uchar* w1,
                                                  const uchar* s1, const uchar* b1, const uchar* w2, const uchar* s2,
                                                  const uchar* b2, const uchar* w3, const uchar* s3, const uchar* b3,
                                                  const float* __restrict__ x, float* out0, float* out1,
                                                  float* out2, float* out3) {
  const uint i = blockIdx.x >= g.ends[0] && g.count > 1
                     ? (blockIdx.x >= g.ends[1] && g.count > 2 ? (blockIdx.x >= g.ends[2] && g.count > 3 ? 3 : 2) : 1)
                     : 0;
  const uint b = blockIdx.x - pick4(i, 0u, g.ends[0], g.ends[1], g.ends[2]);
  const CudaMatrix m = pick4(i, m0, m1, m2, m3);
  const W wr = make_w<W>(pick4(i, w0, w1, w2, w3), pick4(i, s0, s1, s2, s3), pick4(i, b0, b1, b2, b3), m);
  __shared__ __align__(16) float4 xs[GEMV_XS / 4];
  __shared__ float part[8][GEMV_WIDE_ROWS(W)];
  const uint t = blockIdx.y;
  gemv_block<W, GEMV_NC, 32, GEMV_WIDE_ROWS(W)>(wr, m.row_offset, b, g.ks, x + (size_t)(p.x_row0 + t) * m.cols,
                         pick4(i, out0, out1, out2, out3) + (size_t)t * m.rows, xs, part);
}

// matmul_mma_<w>: output tiles of 64 tokens x 128 weight rows (mma_tile in common.cuh: bf16 tensor
// cores, f32 accumulation); grid (ceil(N / 128), ceil(T / 64)), 256 threads = 8 warps. Each weight is
// dequantized once per 64 tokens, each activation converted once per 128 weight rows. Tokens past T
// and rows past N are zero in the tiles and not stored.
template <typename W>
__device__ __forceinline__ void matmul_mma(const MatmulParams p, const CudaMatrix m, const uchar* w,
                                           const uchar* scales, const uchar* biases, const float* __restrict__ x,
                                           float* __restrict__ out) {
  __shared__ __align__(16) ushort smem[MMA_SMEM];
  const W wr = make_w<W>(w, scales, biases, m);
  const uint K = m.cols, N = m.rows, T = p.tokens;
  const uint n0 = blockIdx.x * MMA_N, t0 = blockIdx.y * MMA_T;
  const uint nv = min((uint)MMA_N, N - n0);  // real rows of the tile: the first half's, then the second's
  float acc[2][4][4];
  mma_zero(acc);
  auto a_row = [&](uint i) -> const float* {
    return t0 + i < T ? x + (size_t)(p.x_row0 + t0 + i) * K : nullptr;
  };
  const size_t row0 = (size_t)m.row_offset + n0;
  mma_tile(wr, row0, min(nv, (uint)MMA_H), wr, row0 + MMA_H, nv > MMA_H ? nv - MMA_H : 0u, K, a_row, smem, acc);
  mma_store(acc, [&](uint t, uint n, float v) {
    if (t0 + t < T && n < nv) out[(size_t)(t0 + t) * N + n0 + n] = v;
  });
}

#define MATMUL(sfx)                                                                                            \
  extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS(W_##sfx)) matmul_gemv_##sfx(                                         \
      const MatmulParams p, const CudaMatrix m, const uchar* w, const uchar* s, const uchar* b, const uint ks,  \
      const float* __restrict__ x, float* __restrict__ out) {                                                  \
    grid_dep_launch(); /* grid_dep_wait(): in gemv_staged, after the first weight loads */ \
    matmul_gemv<W_##sfx>(p, m, w, s, b, ks, x, out);                                                               \
  }                                                                                                            \
  SIM_EXPORT(matmul_gemv_##sfx)                                                                                \
  extern "C" __global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_BLOCKS(W_##sfx)) matmul_mma_##sfx(                                          \
      const MatmulParams p, const CudaMatrix m, const uchar* w, const uchar* s, const uchar* b,                \
      const float* __restrict__ x, float* __restrict__ out) {                                                  \
    kernel_start(); \
    matmul_mma<W_##sfx>(p, m, w, s, b, x, out);                                                                \
  }                                                                                                            \
  SIM_EXPORT(matmul_mma_##sfx)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS(W_##sfx)) matmul_gemv_multi_##sfx(                                   \
      const MatmulParams p, const GemvMulti g, const CudaMatrix m0, const CudaMatrix m1, const CudaMatrix m2,   \
      const CudaMatrix m3, const uchar* w0, const uchar* s0, const uchar* b0, const uchar* w1, const uchar* s1, \
      const uchar* b1, const uchar* w2, const uchar* s2, const uchar* b2, const uchar* w3, const uchar* s3,      \
      const uchar* b3, const float* __restrict__ x, float* out0, float* out1, float* out2, float* out3) {      \
    grid_dep_launch(); /* grid_dep_wait(): in gemv_staged, after the first weight loads */ \
    matmul_gemv_multi<W_##sfx>(p, g, m0, m1, m2, m3, w0, s0, b0, w1, s1, b1, w2, s2, b2, w3, s3, b3, x, out0,   \
                               out1, out2, out3);                                                              \
  }                                                                                                            \
  SIM_EXPORT(matmul_gemv_multi_##sfx)
FOR_EACH_WEIGHT(MATMUL)
