// matmul: out [T, N] = x[x_row0 + t, :K] W^T for W [N, K] (dense f32/f16/bf16 or MLX affine
// 2/4/8-bit with bf16/f16/f32 scales and biases), dequantized in the kernel.
// Bindings: 0 MatmulParams, 1 MatrixDesc (N = rows, K = cols), 2 w, 3 scales, 4 biases (a dummy
// buffer for dense weights), 5 x [*, K] f32, 6 out [T, N] f32.
// Grid: threadgroups (ceil(N / 4), ceil(T / TT)), 128 threads = 4 simdgroups; simdgroup s owns
// output row 4 * tg.x + s for the TT tokens TT * tg.y ..; lanes take 8 consecutive columns at a
// time, so one dequantized chunk serves all TT tokens. TT = 1 is the decode GEMV
// (matmul_gemv_<w>), TT = 8 the prefill GEMM (matmul_gemm_<w>). Accumulation: f32.
#include "common.h"

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

#define MATMUL(sfx) INSTANTIATE(matmul_gemv_##sfx, matmul, W_##sfx, 1) INSTANTIATE(matmul_gemm_##sfx, matmul, W_##sfx, 8)
FOR_EACH_WEIGHT(MATMUL)
