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

// matmul_mma_<w>: output tiles of 64 tokens x 64 weight rows; grid (ceil(N / 64), ceil(T / 64)),
// 128 threads = 4 warps, warp w owning tokens 32 (w / 2) .. + 32 and rows 32 (w % 2) .. + 32 as
// 2 x 4 m16n8 accumulators. Per K step of 64 the block stages x [64 tokens][64] and the
// dequantized W [64 rows][64] as bf16 in shared memory (rows padded to 72 halves: the fragment
// reads of a warp hit 32 different banks), zero outside T, N and K; then 4 k16 steps of
// mma.sync m16n8k16 (bf16 inputs, f32 accumulation) with fragments read straight from shared
// memory. Each weight is dequantized once per 64 tokens.
#define MMA_T 64
#define MMA_N 64
#define MMA_K 64
#define MMA_LD 72
template <typename W>
__device__ __forceinline__ void matmul_mma(const MatmulParams p, const CudaMatrix m, const uchar* w,
                                           const uchar* scales, const uchar* biases, const float* __restrict__ x,
                                           float* __restrict__ out) {
  __shared__ __align__(16) ushort xs[MMA_T * MMA_LD];
  __shared__ __align__(16) ushort ws[MMA_N * MMA_LD];
  const W wr = make_w<W>(w, scales, biases, m);
  const uint K = m.cols, N = m.rows, T = p.tokens;
  const uint n0 = blockIdx.x * MMA_N, t0 = blockIdx.y * MMA_T;
  const uint tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  const uint wt = (warp / 2) * 32, wn = (warp % 2) * 32;
  float acc[2][4][4];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j)
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
  for (uint k0 = 0; k0 < K; k0 += MMA_K) {
    // x tile: thread tid converts 32 values: row tid / 2, columns 32 (tid % 2) ..
    {
      const uint r = tid / 2, c0 = (tid % 2) * 32;
      const bool row_ok = t0 + r < T;
      const float* xr = x + (size_t)(p.x_row0 + t0 + r) * K + k0 + c0;
      for (uint c = 0; c < 32; c += 2) {
        const float a = row_ok && k0 + c0 + c < K ? xr[c] : 0.0f;
        const float b = row_ok && k0 + c0 + c + 1 < K ? xr[c + 1] : 0.0f;
        *reinterpret_cast<uint*>(&xs[r * MMA_LD + c0 + c]) = pack_bf16x2(a, b);
      }
    }
    // W tile: chunk by chunk (EPC columns), element by element at the edges.
    constexpr uint CPR = MMA_K / W::EPC;  // chunks per tile row
    for (uint q = tid; q < MMA_N * CPR; q += 128) {
      const uint r = q / CPR, c0 = (q % CPR) * W::EPC;
      const bool row_ok = n0 + r < N;
      const size_t row = m.row_offset + n0 + r;
      float v[W::EPC];
      if (row_ok && m.vec && k0 + c0 + W::EPC <= K) {
        wr.chunk(row, (k0 + c0) / W::EPC, v);
      } else {
        for (uint i = 0; i < (uint)W::EPC; ++i) v[i] = row_ok && k0 + c0 + i < K ? wr.at(row, k0 + c0 + i) : 0.0f;
      }
      for (uint i = 0; i < (uint)W::EPC; i += 2)
        *reinterpret_cast<uint*>(&ws[r * MMA_LD + c0 + i]) = pack_bf16x2(v[i], v[i + 1]);
    }
    __syncthreads();
    for (uint kk = 0; kk < MMA_K; kk += 16) {
      uint a[2][4], b[4][2];
      for (uint i = 0; i < 2; ++i) {
        const ushort* base = xs + (wt + 16 * i + g) * MMA_LD + kk + 2 * tq;
        a[i][0] = *reinterpret_cast<const uint*>(base);
        a[i][1] = *reinterpret_cast<const uint*>(base + 8 * MMA_LD);
        a[i][2] = *reinterpret_cast<const uint*>(base + 8);
        a[i][3] = *reinterpret_cast<const uint*>(base + 8 * MMA_LD + 8);
      }
      for (uint j = 0; j < 4; ++j) {
        const ushort* base = ws + (wn + 8 * j + g) * MMA_LD + kk + 2 * tq;
        b[j][0] = *reinterpret_cast<const uint*>(base);
        b[j][1] = *reinterpret_cast<const uint*>(base + 8);
      }
      for (uint i = 0; i < 2; ++i)
        for (uint j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < 4; ++j)
      for (uint e = 0; e < 4; ++e) {
        const uint t = t0 + wt + 16 * i + g + (e >= 2 ? 8 : 0), n = n0 + wn + 8 * j + 2 * tq + (e & 1);
        if (t < T && n < N) out[(size_t)t * N + n] = acc[i][j][e];
      }
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
  SIM_EXPORT(matmul_mma_##sfx)
FOR_EACH_WEIGHT(MATMUL)
