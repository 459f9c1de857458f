// Elementwise ops over [T, dim] f32 rows (host: ops/elementwise/metal.rs). Grid: dispatchThreads
// (dim, T), one thread per element, threadgroups of 64 along dim. No reductions.
//   add:              x += y                                  bindings 0 RowsParams, 1 x (in/out), 2 y
//   swiglu:           out = silu(gate) * up                   0 RowsParams, 1 gate, 2 up, 3 out
//   sigmoid_gate_add: out[t, :] += sigmoid(gate[t]) * y[t, :] 0 RowsParams, 1 y, 2 gate [T], 3 out
//   copy_rows:        dst = src                               0 RowsParams, 1 src, 2 dst (each bound at its
//                     offset: a batched decode moves one sequence's rows in and out of the batch in-stream)
#include "common.h"

kernel void add_f32(constant RowsParams& p [[buffer(0)]], device float* x [[buffer(1)]],
                    device const float* y [[buffer(2)]], uint2 pos [[thread_position_in_grid]]) {
  if (pos.x >= p.dim || pos.y >= p.tokens) return;
  const ulong i = (ulong)pos.y * p.dim + pos.x;
  x[i] = x[i] + y[i];
}

kernel void swiglu_f32(constant RowsParams& p [[buffer(0)]], device const float* gate [[buffer(1)]],
                       device const float* up [[buffer(2)]], device float* out [[buffer(3)]],
                       uint2 pos [[thread_position_in_grid]]) {
  if (pos.x >= p.dim || pos.y >= p.tokens) return;
  const ulong i = (ulong)pos.y * p.dim + pos.x;
  out[i] = silu(gate[i]) * up[i];
}

kernel void sigmoid_gate_add_f32(constant RowsParams& p [[buffer(0)]], device const float* y [[buffer(1)]],
                                 device const float* gate [[buffer(2)]], device float* out [[buffer(3)]],
                                 uint2 pos [[thread_position_in_grid]]) {
  if (pos.x >= p.dim || pos.y >= p.tokens) return;
  const ulong i = (ulong)pos.y * p.dim + pos.x;
  out[i] = out[i] + sigmoid(gate[pos.y]) * y[i];
}

kernel void copy_rows_f32(constant RowsParams& p [[buffer(0)]], device const float* src [[buffer(1)]],
                          device float* dst [[buffer(2)]], uint2 pos [[thread_position_in_grid]]) {
  if (pos.x >= p.dim || pos.y >= p.tokens) return;
  const ulong i = (ulong)pos.y * p.dim + pos.x;
  dst[i] = src[i];
}
