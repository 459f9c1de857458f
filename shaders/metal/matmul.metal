// matmul: out [T, N] = x[x_row0 + t, :K] W^T for W [N, K] (dense f32/f16/bf16 or MLX affine
// 2/4/8-bit with bf16/f16/f32 scales and biases), dequantized in the kernel. Three kernels, one
// result (accumulation: f32 throughout), chosen by the host on T: matmul_gemv (T = 1, decode),
// matmul_gemm (T = 2..8), matmul_mma (T > 8, prefill). The GEMV and the simdgroup-matrix GEMM
// come in GPU-family variants (host-name suffix `_r2` / `_r4`, `_n32` / `_n64`; the table that
// picks them is backend/metal/kernels.rs `Variants::for_family`). Host: ops/matmul/metal.rs.
// Bindings (all three): 0 MatmulParams, 1 MatrixDesc (N = rows, K = cols), 2 w, 3 scales,
// 4 biases (a dummy buffer for dense weights), 5 x [*, K] f32, 6 out [T, N] f32.
#include "common.h"

// matmul_gemv_<w>_r<R>: the decode GEMV, T = 1. Grid: threadgroups (ceil(N / (4 R))), 128
// threads = 4 simdgroups; simdgroup s owns the R output rows (4 tg.x + s) R .. + R (rows_dot in
// common.h: lanes over K, 8 consecutive columns at a time, one x chunk for the R rows; a partial
// last group of rows repeats its last row and stores only the valid ones). R = 2 on Apple7/8,
// 4 on Apple9+ (see kernels.rs).
template <typename W, int R>
TKERNEL void matmul_gemv(constant MatmulParams& p [[buffer(0)]], constant MatrixDesc& m [[buffer(1)]],
                         device const uchar* w [[buffer(2)]], device const uchar* scales [[buffer(3)]],
                         device const uchar* biases [[buffer(4)]], device const float* x [[buffer(5)]],
                         device float* out [[buffer(6)]], uint3 tg [[threadgroup_position_in_grid]],
                         uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                         uint nsg [[simdgroups_per_threadgroup]]) {
  const uint r0 = (tg.x * nsg + sg) * R;
  if (r0 >= m.rows) return;  // whole simdgroup: no collective is left waiting
  const uint nr = min((uint)R, m.rows - r0);
  const W wr = W::make(w, scales, biases, m);
  float dots[R];
  rows_dot<W, R>(wr, m.row_offset + r0, nr, m.cols, x + (ulong)p.x_row0 * m.cols, lane, dots);
  if (lane == 0)
    for (uint r = 0; r < nr; ++r) out[r0 + r] = dots[r];
}

// matmul_gemm_<w>: 2..8 tokens. Grid: threadgroups (ceil(N / 4), ceil(T / 8)), 128 threads =
// 4 simdgroups; simdgroup s owns output row 4 * tg.x + s for the 8 tokens 8 * tg.y ..; lanes take
// 8 consecutive columns at a time, so one dequantized chunk serves all the tokens. Accumulation:
// f32. (No GPU-family variants: 2..8 tokens is a rare shape, a short prompt or a prefill tail.)
template <typename W, int TT>
TKERNEL void matmul(constant MatmulParams& p [[buffer(0)]], constant MatrixDesc& m [[buffer(1)]],
                    device const uchar* w [[buffer(2)]], device const uchar* scales [[buffer(3)]],
                    device const uchar* biases [[buffer(4)]], device const float* x [[buffer(5)]],
                    device float* out [[buffer(6)]], uint3 tg [[threadgroup_position_in_grid]],
                    uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const uint r = tg.x * 4 + sg;
  if (r >= m.rows) return;  // whole simdgroup: no collective is left waiting
  const W wr = W::make(w, scales, biases, m);
  const uint row = m.row_offset + r;
  const uint K = m.cols;
  const uint t0 = tg.y * TT;
  const uint nt = min((uint)TT, p.tokens - t0);
  float acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
  const uint k8 = K / 8 * 8;
  for (uint j = lane * 8; j < k8; j += 256) {
    float wv[8];
    wr.load8(row, j, wv);
    for (uint t = 0; t < nt; ++t) {
      device const float* xt = x + (ulong)(p.x_row0 + t0 + t) * K + j;
      float s = 0.0f;
      for (int i = 0; i < 8; ++i) s += wv[i] * xt[i];
      acc[t] += s;
    }
  }
  for (uint j = k8 + lane; j < K; j += 32) {
    const float wj = wr.at(row, j);
    for (uint t = 0; t < nt; ++t) acc[t] += wj * x[(ulong)(p.x_row0 + t0 + t) * K + j];
  }
  for (int t = 0; t < TT; ++t) {
    const float total = simd_sum(acc[t]);
    if (lane == 0 && (uint)t < nt) out[(ulong)(t0 + t) * m.rows + r] = total;
  }
}

// matmul_mma_<w>_n<TN>: the prefill GEMM for T > 8 tokens on simdgroup matrices. Output tiles of
// 32 tokens x TN weight rows (TN = 32 on Apple7/8, 64 on Apple9+). Grid: threadgroups
// (ceil(N / TN), ceil(T / 32)), 128 threads = 4 simdgroups in a 2x2 arrangement; simdgroup s owns
// tokens 16 (s / 2) .. +16 and rows (TN / 2) (s % 2) .. + TN / 2 of the tile, as 2 x (TN / 16)
// 8x8 f32 accumulators. Per K step of 32 the threadgroup stages x [32 tokens][32] and the
// dequantized W [TN rows][32] as f32 in threadgroup memory (zero outside T, N and K, so partial
// tiles need no other care): thread i fills 8 consecutive columns of x row i / 4 and of W rows
// i / 4 + 32 j (one load8 per row: each weight is dequantized once for all 32 tokens). Each
// simdgroup then multiplies 4 k-slices, loading W transposed (B[k][n] = W[n][k]). The accumulators
// leave through threadgroup memory (the W tile's, as [32 tokens][TN rows]) so the partial edges
// are stored bounds-checked. Accumulation: f32, in the same order for every TN.
// Threadgroup memory: argument 0 holds 32 * 32 floats (4 KiB), argument 1 TN * 32 floats (4 or
// 8 KiB), sized by the host (template kernels cannot declare kernel-scope threadgroup arrays in
// the C++-for-OpenCL check mode). MMA_TILE (params.h) = 32.
template <typename W, int TN>
TKERNEL void matmul_mma(constant MatmulParams& p [[buffer(0)]], constant MatrixDesc& m [[buffer(1)]],
                        device const uchar* w [[buffer(2)]], device const uchar* scales [[buffer(3)]],
                        device const uchar* biases [[buffer(4)]], device const float* x [[buffer(5)]],
                        device float* out [[buffer(6)]],
                        threadgroup float* xs [[threadgroup(0)]],  // [token][k]
                        threadgroup float* ws [[threadgroup(1)]],  // [row][k] dequantized, then the output tile [token][row]
                        uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int NB = TN / 16;  // 8-row blocks of each simdgroup's half of the tile
  const W wr = W::make(w, scales, biases, m);
  const uint K = m.cols, N = m.rows;
  const uint n0 = tg.x * TN, t0 = tg.y * MMA_TILE;
  const uint st = (sg / 2) * 16, sn = (sg % 2) * (TN / 2);  // this simdgroup's 16 x TN/2 sub-tile
  const uint lr = tid / 4, lc = (tid % 4) * 8;              // staging: tile row, first of 8 columns
  simdgroup_float8x8 acc[2][NB];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k0 = 0; k0 < K; k0 += MMA_TILE) {
    const uint j = k0 + lc;
    threadgroup float* xd = xs + lr * MMA_TILE + lc;
    if (t0 + lr < p.tokens) {
      device const float* xr = x + (ulong)(p.x_row0 + t0 + lr) * K;
      for (uint i = 0; i < 8; ++i) xd[i] = j + i < K ? xr[j + i] : 0.0f;
    } else {
      for (uint i = 0; i < 8; ++i) xd[i] = 0.0f;
    }
    for (uint rr = lr; rr < (uint)TN; rr += MMA_TILE) {
      threadgroup float* wd = ws + rr * MMA_TILE + lc;
      const uint row = m.row_offset + n0 + rr;
      if (n0 + rr < N && j + 8 <= K) {
        float wv[8];
        wr.load8(row, j, wv);
        for (int i = 0; i < 8; ++i) wd[i] = wv[i];
      } else {
        for (uint i = 0; i < 8; ++i) wd[i] = n0 + rr < N && j + i < K ? wr.at(row, j + i) : 0.0f;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < MMA_TILE; kk += 8) {
      simdgroup_float8x8 a[2], b[NB];
      for (uint i = 0; i < 2; ++i) simdgroup_load(a[i], xs + (st + 8 * i) * MMA_TILE + kk, MMA_TILE);
      // b[j][k][n] = ws[sn + 8 j + n][kk + k]: a transposed load.
      for (uint i = 0; i < (uint)NB; ++i)
        simdgroup_load(b[i], ws + (sn + 8 * i) * MMA_TILE + kk, MMA_TILE, ulong2(0, 0), true);
      for (int i = 0; i < 2; ++i)
        for (int jj = 0; jj < NB; ++jj) simdgroup_multiply_accumulate(acc[i][jj], a[i], b[jj], acc[i][jj]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < 2; ++i)
    for (uint jj = 0; jj < (uint)NB; ++jj) simdgroup_store(acc[i][jj], ws + (st + 8 * i) * TN + sn + 8 * jj, TN);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < MMA_TILE * (uint)TN; e += 128) {
    const uint t = t0 + e / TN, n = n0 + e % TN;
    if (t < p.tokens && n < N) out[(ulong)t * N + n] = ws[e];
  }
}

#define MATMUL(sfx)                                          \
  INSTANTIATE(matmul_gemv_##sfx##_r2, matmul_gemv, W_##sfx, 2) \
  INSTANTIATE(matmul_gemv_##sfx##_r4, matmul_gemv, W_##sfx, 4) \
  INSTANTIATE(matmul_gemm_##sfx, matmul, W_##sfx, 8)         \
  INSTANTIATE(matmul_mma_##sfx##_n32, matmul_mma, W_##sfx, 32) \
  INSTANTIATE(matmul_mma_##sfx##_n64, matmul_mma, W_##sfx, 64)
FOR_EACH_WEIGHT(MATMUL)
