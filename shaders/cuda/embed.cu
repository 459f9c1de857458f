// embed_<w>: out [T, D] = dequant(table row ids[t]) for a table [V, D] in any weight format.
// Arguments: uint tokens, CudaMatrix m (V = rows, D = cols), w, scales, biases, ids [T] u32 (on
// the device: the token of a decode step is written there, not baked into a captured graph),
// out [T, D] f32. Grid (ceil(D / 256), T), 256 threads, one element per thread.
#include "common.cuh"

template <typename W>
__device__ __forceinline__ void embed(const uint tokens, const CudaMatrix m, const uchar* w, const uchar* s,
                                      const uchar* b, const uint* __restrict__ ids, float* __restrict__ out) {
  const uint j = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
  if (j >= m.cols || t >= tokens) return;
  const W wr = make_w<W>(w, s, b, m);
  const uint id = min(ids[t], m.rows - 1);  // the host checked the ids; a bad one cannot read past the table
  out[(size_t)t * m.cols + j] = wr.at((size_t)m.row_offset + id, j);
}

#define EMBED(sfx)                                                                                    \
  extern "C" __global__ void embed_##sfx(const uint tokens, const CudaMatrix m, const uchar* w,       \
                                         const uchar* s, const uchar* b, const uint* __restrict__ ids, \
                                         float* __restrict__ out) {                                   \
    kernel_start(); \
    embed<W_##sfx>(tokens, m, w, s, b, ids, out);                                                     \
  }                                                                                                   \
  SIM_EXPORT(embed_##sfx)
FOR_EACH_WEIGHT(EMBED)
