// Planted bugs the simulator must catch (crates/lily-core/tests/cuda_sim.rs), each beside its
// correct twin. Every kernel: x [n] f32 (input 0..n), out [n] f32 (poisoned), n.
#include "common.cuh"

// Block sum through shared memory; the last thread of the block reduces.
extern "C" __global__ void block_sum_ok(const float* x, float* out, uint n) {
  __shared__ float s[65];
  const uint i = blockIdx.x * blockDim.x + threadIdx.x, last = blockDim.x - 1;
  s[threadIdx.x] = i < n ? x[i] : 0.0f;
  __syncthreads();
  if (threadIdx.x == last) {
    float t = 0.0f;
    for (uint j = 0; j < blockDim.x; ++j) t += s[j];
    s[64] = t;
  }
  __syncthreads();
  if (i < n) out[i] = s[64];
}

// Mutant: no barrier between the writes to s and the last thread's reads of them. In forward
// order the last thread runs after the others have written; reversed, it reads the poison.
extern "C" __global__ void block_sum_no_barrier(const float* x, float* out, uint n) {
  __shared__ float s[65];
  const uint i = blockIdx.x * blockDim.x + threadIdx.x, last = blockDim.x - 1;
  s[threadIdx.x] = i < n ? x[i] : 0.0f;
  if (threadIdx.x == last) {
    float t = 0.0f;
    for (uint j = 0; j < blockDim.x; ++j) t += s[j];
    s[64] = t;
  }
  __syncthreads();
  if (i < n) out[i] = s[64];
}

// Mutant: a butterfly with a wrong lane mask (o / 2: lane 16 is never reached, the last step adds
// the lane to itself).
extern "C" __global__ void warp_sum_wrong_xor(const float* x, float* out, uint n) {
  float v = threadIdx.x < n ? x[threadIdx.x] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o >> 1);
  if (threadIdx.x < n) out[threadIdx.x] = v;
}

// Mutant: every lane shuffles, but the mask names only the lower 16.
extern "C" __global__ void warp_sum_partial_mask(const float* x, float* out, uint n) {
  float v = threadIdx.x < n ? x[threadIdx.x] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);
  if (threadIdx.x < n) out[threadIdx.x] = v;
}

// Mutant: the upper half of the warp returns before a full-mask warp reduction.
extern "C" __global__ void shuffle_after_return(const float* x, float* out, uint n) {
  if (threadIdx.x >= 16) return;
  const float v = warp_sum(x[threadIdx.x]);
  out[threadIdx.x] = v;
}

// Mutant: writes one block of 64 threads into a buffer of n < 64 floats.
extern "C" __global__ void write_past_end(const float* x, float* out, uint n) {
  (void)x;
  out[threadIdx.x] = (float)n;
}

// One m16n8k16 product: A [16][16] = x[0..256) row-major, B [16][8] = x[0..128) (B[k][n] =
// x[8 k + n]); out[8 r + c] = D[r][c]. Fragments loaded as the PTX ISA lays them out.
__device__ __forceinline__ void mma_tile(const float* x, float* out, bool swap) {
  const uint lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  uint a[4], b[2];
  auto A = [&](uint r, uint k) { return x[r * 16 + k]; };
  auto B = [&](uint k, uint n) { return x[k * 8 + n]; };
  a[0] = pack_bf16x2(A(g, 2 * t), A(g, 2 * t + 1));
  a[1] = pack_bf16x2(A(g + 8, 2 * t), A(g + 8, 2 * t + 1));
  a[2] = pack_bf16x2(A(g, 2 * t + 8), A(g, 2 * t + 9));
  a[3] = pack_bf16x2(A(g + 8, 2 * t + 8), A(g + 8, 2 * t + 9));
  if (swap) {
    const uint tmp = a[1];
    a[1] = a[2];
    a[2] = tmp;
  }
  b[0] = pack_bf16x2(B(2 * t, g), B(2 * t + 1, g));
  b[1] = pack_bf16x2(B(2 * t + 8, g), B(2 * t + 9, g));
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d[4];
  mma_bf16_16816(d, a, b, c);
  out[g * 8 + 2 * t] = d[0];
  out[g * 8 + 2 * t + 1] = d[1];
  out[(g + 8) * 8 + 2 * t] = d[2];
  out[(g + 8) * 8 + 2 * t + 1] = d[3];
}
extern "C" __global__ void mma_ok(const float* x, float* out, uint n) {
  (void)n;
  mma_tile(x, out, false);
}
// Mutant: A fragment registers 1 and 2 swapped (rows g + 8 and columns 2t + 8 exchanged).
extern "C" __global__ void mma_wrong_fragment(const float* x, float* out, uint n) {
  (void)n;
  mma_tile(x, out, true);
}
