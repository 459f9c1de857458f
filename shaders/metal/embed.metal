// embed: out [T, D] = dequant(table row ids[t]) for a table [V, D] in any weight format (host:
// ops/embed/metal.rs).
// Bindings: 0 EmbedParams, 1 MatrixDesc (V = rows, D = cols), 2 w, 3 scales, 4 biases,
// 5 ids [T] u32, 6 out [T, D] f32. Grid: dispatchThreads (D, T); one thread per element.
#include "common.h"

template <typename W>
TKERNEL void embed(constant EmbedParams& p [[buffer(0)]], constant MatrixDesc& m [[buffer(1)]],
                   device const uchar* w [[buffer(2)]], device const uchar* scales [[buffer(3)]],
                   device const uchar* biases [[buffer(4)]], device const uint* ids [[buffer(5)]],
                   device float* out [[buffer(6)]], uint2 pos [[thread_position_in_grid]]) {
  const uint j = pos.x, t = pos.y;
  if (j >= m.cols || t >= p.tokens) return;
  const W wr = W::make(w, scales, biases, m);
  out[(ulong)t * m.cols + j] = wr.at(m.row_offset + ids[t], j);
}

#define EMBED(sfx) INSTANTIATE(embed_##sfx, embed, W_##sfx)
FOR_EACH_WEIGHT(EMBED)
