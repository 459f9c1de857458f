// Shared helpers of the CUDA kernels: 16-bit float conversions by bits (no cuda_fp16.h /
// cuda_bf16.h: NVRTC installs may lack them), the few PTX instructions the kernels use (each with
// its CPU emulation for tools/cuda-sim behind LILY_CUDA_SIM), warp / block reductions, the weight
// readers (dense f32/f16/bf16 and MLX affine 2/4/8-bit with bf16/f16/f32 scales), and the
// CUDA-only argument structs (mirrored by crates/lily-core/src/backend/cuda/args.rs, sizes checked
// on both sides). Activations are f32 in device memory; every reduction accumulates in f32.
#pragma once
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long long u64;
#include "params.h"

// A kernel the host launches by name: C linkage, so NVRTC keeps the name and the simulator
// exports it (SIM_EXPORT is for kernels defined inside macros; the simulator's lowering exports
// the ones written out).
#if defined(LILY_CUDA_SIM)
#define SIM_EXPORT(name) CUDA_SIM_EXPORT(name)
#else
#define SIM_EXPORT(name)
#endif

// Programmatic dependent launch (sm_90+, the host's launch attribute): a kernel may start while
// the one before it in the stream still runs. grid_dep_wait() returns once every earlier kernel has
// finished and its writes are visible; every kernel calls it before its first access to memory other
// than weights (reads of weights, which no kernel writes, may come before it: a GEMV issues its
// first weight loads, then waits), or to what only an earlier forward call wrote (every call ends
// in a stream synchronization), read through L2 (load_l2): the decode attention's KV rows,
// delta_net_gated's states. ptxas may schedule an ld.global.nc load (a `const __restrict__`
// pointer's, __ldg) above griddepcontrol.wait (SASS ACQBULK): it did so with delta_net_gated's z
// once the state loads preceded the wait (2026-12-07), which then read z stale. So in a kernel
// whose loads precede its wait, what the kernels before it wrote is read after the wait through
// load_l2 (ptxas keeps those after it). The nc loads after the waits of the other kernels (the
// GEMVs' x, the attention's q) sit after them in the sm_90 SASS: scripts/cuda_wait_audit.py
// lists, kernel by kernel, the loads issued before each wait (here: weights, load_l2's and a
// compiler constant table). Without the attribute, below sm_90 and in the simulator it is a
// no-op, so the kernels are correct either way.
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(LILY_CUDA_SIM)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// grid_dep_launch() lets the next kernel of the stream be scheduled once every block of this one has
// called it (or exited): its blocks become resident and run up to their grid_dep_wait() (a GEMV issues
// its first weight loads) while this kernel drains. Correctness does not depend on where it is called,
// since the dependent still waits in grid_dep_wait() for this kernel's completion and memory flush;
// every kernel calls it at its start, with grid_dep_wait(): kernel_start(). A kernel so scheduled
// early may schedule the next one at its own start, so before its grid_dep_wait() a kernel cannot
// assume that any kernel before it has finished, except where the kernel before it calls this only
// after its own wait: moe_gate_up does, so that moe_down may read the routing (which the router,
// the kernel before moe_gate_up, wrote) before its wait and fetch its experts' weights early.
__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(LILY_CUDA_SIM)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The opening of a kernel whose first access is to memory other than weights: let the next kernel be
// scheduled (its blocks take only what this kernel's resident blocks leave, since the trigger fires
// once all of them have started), then wait for the kernels before this one.
__device__ __forceinline__ void kernel_start() {
  grid_dep_launch();
  grid_dep_wait();
}

// fence.acq_rel at device scope (the simulator runs one block at a time: any fence will do).
__device__ __forceinline__ void fence_acq_rel_gpu() {
#if defined(LILY_CUDA_SIM)
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#else
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
#endif
}
// Last-block-done, for a kernel whose last block of a group reads what the group's other blocks
// stored (moe_router's routing, the decode attention's combine, delta_net_gated's norm, argmax):
// every thread of the block calls it after its stores. Thread 0 alone fences and counts: the
// barrier orders the block's stores before its release fence (fence.acq_rel.gpu is cumulative),
// then one atomicAdd on *count; the block that sees `of` - 1 is the last of the group, sets *count
// back to 0 for the next launch (graph replays included) and fences again (acquire) before the
// barrier that releases its threads to read the others' stores (through L2: load_l2 or volatile;
// never a plain load, which may hit a stale L1 line of an earlier launch). flag: the caller's
// __shared__ uint[1]. Returns true in the last block. Why not every thread's __threadfence(): 256
// sequentially consistent fences a block, and a second round of them in the last block, took 3,055
// cycles of moe_router's tail on an H100, this 2,032 (clock64 probe, 2026-12-07); CUDA's own grid
// barrier fences in one thread the same way.
__device__ __forceinline__ bool last_block(uint* count, uint of, uint* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_gpu();  // release: the block's stores before its count
    const bool last = atomicAdd(count, 1u) == of - 1;
    if (last) {
      *count = 0u;  // every block of the group has counted
      fence_acq_rel_gpu();  // acquire: the others' stores before this block's reads
    }
    flag[0] = last ? 1u : 0u;
  }
  __syncthreads();
  return flag[0] != 0u;
}

// ---------------------------------------------------------------- CUDA-only arguments
// A weight matrix [experts?, rows, cols] as the kernels see it: logical row r of expert e is
// stored row e * expert_stride + row_offset + r; `group` is the quantization group (0: dense);
// `row_bytes` the bytes of one stored row; `vec` = 1 when rows start 16-byte aligned (row_bytes
// % 16 == 0), so a lane may read 16-byte chunks; `group_shift` = log2(group) when the group is a
// power of two (the GEMV finds a column's group by a shift instead of a division), else 0.
struct CudaMatrix { uint rows; uint cols; uint expert_stride; uint row_offset; uint group; uint row_bytes; uint vec; uint group_shift; };
static_assert(sizeof(CudaMatrix) == 32, "CudaMatrix");
// A KV cache as the attention kernels see it (the segmented 16-bit cache of issue 13): row r of
// the cache lives in segment r >> seg_shift at row r & ((1 << seg_shift) - 1); `seg` is a device
// array of segment base addresses (u64 each, allocated once for max_seq so its address never
// changes: a captured graph stays valid as segments are added); `dtype` 0 f32, 1 bf16, 2 f16;
// `width` elements a row.
struct KvDesc { u64 seg; uint width; uint dtype; uint seg_shift; uint pad; };
static_assert(sizeof(KvDesc) == 24, "KvDesc");
// Up to 4 matrices of one weight format and one K multiplied with the same x in one launch
// (matmul_gemv_multi): matrix i owns the blocks ends[i - 1] .. ends[i] - 1 of the grid.
struct GemvMulti { uint count; uint ends[4]; uint ks; uint pad[2]; };
static_assert(sizeof(GemvMulti) == 32, "GemvMulti");
// The expert-sorted prefill path of moe.cu: E experts, room for `max_tiles` 64-row tiles.
struct MoeSortArgs { uint experts; uint max_tiles; };
static_assert(sizeof(MoeSortArgs) == 8, "MoeSortArgs");

// ---------------------------------------------------------------- bits and conversions
__device__ __forceinline__ float bits_float(uint b) { return __uint_as_float(b); }
__device__ __forceinline__ float bf16_float(ushort b) { return __uint_as_float((uint)b << 16); }
// f32 -> bf16 bits, round to nearest even; NaN stays NaN (quiet).
__device__ __forceinline__ ushort float_bf16(float f) {
  const uint u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (ushort)((u >> 16) | 0x40u);
  return (ushort)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// Two f32 -> one bf16x2 register (lo in the low half), round to nearest even: the operand form of
// the tensor-core mma. PTX cvt.rn.bf16x2.f32 (sm_80+) on the GPU.
__device__ __forceinline__ uint pack_bf16x2(float lo, float hi) {
#if defined(LILY_CUDA_SIM)
  return (uint)float_bf16(lo) | ((uint)float_bf16(hi) << 16);
#else
  uint r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}
// IEEE half bits -> f32 (exact). PTX cvt.f32.f16 on the GPU.
__device__ __forceinline__ float f16_float(ushort h) {
#if defined(LILY_CUDA_SIM)
  const uint s = (uint)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return __uint_as_float(s | 0x7f800000u | (m << 13));
  if (e != 0) return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
  const float v = (float)m * 5.9604644775390625e-8f;  // subnormal: m * 2^-24
  return s ? -v : v;
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}
// f32 -> IEEE half bits, round to nearest even. PTX cvt.rn.f16.f32 on the GPU.
__device__ __forceinline__ ushort float_f16(float f) {
#if defined(LILY_CUDA_SIM)
  const uint u = __float_as_uint(f), s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (ushort)(s | 0x7e00u);                   // NaN
  if (a >= 0x477ff000u) return (ushort)(s | 0x7c00u);                  // overflow (incl. rounding) -> inf
  if (a < 0x38800000u) {                                               // subnormal half or zero
    const float v = __uint_as_float(a) * 16777216.0f;                  // scale by 2^24: units of 2^-24
    return (ushort)(s | (uint)rintf(v));
  }
  const uint r = a - 0x38000000u;                                      // rebias exponent 127 -> 15
  return (ushort)(s | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
#else
  ushort h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}

// Column i of row `row` of a segmented KV cache (KvDesc: row r is row r & (2^seg_shift - 1) of
// segment r >> seg_shift) set to v in the cache dtype (0 f32, 1 bf16, 2 f16; rounded to nearest even).
__device__ __forceinline__ void kv_put(const KvDesc d, uint row, uint i, float v) {
  const u64 base = reinterpret_cast<const u64*>(d.seg)[row >> d.seg_shift];
  const size_t at = (size_t)(row & ((1u << d.seg_shift) - 1)) * d.width + i;
  if (d.dtype == 0)
    reinterpret_cast<float*>(base)[at] = v;
  else
    reinterpret_cast<ushort*>(base)[at] = d.dtype == 1 ? float_bf16(v) : float_f16(v);
}

// D = A B + C on the tensor cores: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (one warp;
// fragment layouts in tools/cuda-sim/include/cuda_sim.h, as the PTX ISA gives them).
__device__ __forceinline__ void mma_bf16_16816(float d[4], const uint a[4], const uint b[2], const float c[4]) {
#if defined(LILY_CUDA_SIM)
  ::cuda_sim::mma_m16n8k16_bf16(d, a, b, c, __builtin_LINE());
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
#endif
}

// *p for weights, which a decode step reads once each (T: uint4, uint, ushort): ld.global.cs, the
// streaming hint (evict-first in L1 and L2), so the step's ~1.8 GB of weights passing through the
// 50 MB L2 go first rather than what the step reads again (activations, partials, the KV cache and
// the DeltaNet state: which of these gains was not measured). Against __ldg on an H100 (12-layer
// full-width synthetic, three alternating rounds, 2026-12-07): 0.708-0.712 against 0.715-0.716 ms
// a step at depth 512 and 0.725-0.726 against 0.736-0.749 at 4,096; prefill unchanged.
template <typename T> __device__ __forceinline__ T load_stream(const T* p) {
#if defined(LILY_CUDA_SIM)
  T v;
  memcpy(&v, p, sizeof(T));  // the simulator's buffers may start anywhere
  return v;
#else
  return __ldcs(p);
#endif
}
// 16 bytes of weights from p (16-byte aligned on the GPU; the simulator's may start anywhere).
__device__ __forceinline__ uint4 load16(const void* p) { return load_stream(reinterpret_cast<const uint4*>(p)); }
// *p through L2 only (ld.global.cg), never a line of this SM's L1 (T: uint, u64, uint4): for what
// earlier steps or the host wrote and a kernel reads before its grid_dep_wait() (the decode
// attention's position, segment table and first KV stage). L1 is not coherent: a block of an
// earlier step on this SM may have left a stale copy of the line in it (measured: delta_net_gated's
// state read that way before the wait, through L1, gave wrong results under programmatic launch on
// the H200, 2026-12-02 19:52); L2 is coherent.
template <typename T> __device__ __forceinline__ T load_l2(const T* p) {
#if defined(LILY_CUDA_SIM)
  T v;
  memcpy(&v, p, sizeof(T));  // the simulator's buffers may start anywhere
  return v;
#else
  return __ldcg(p);
#endif
}
__device__ __forceinline__ float4 load_f4(const float* p) {
#if defined(LILY_CUDA_SIM)
  float4 v;
  memcpy(&v, p, 16);
  return v;
#else
  return *reinterpret_cast<const float4*>(p);
#endif
}

// Four products of the unsigned bytes of a (8-bit codes) with the signed bytes of b (an int8
// activation plane), added to c: PTX dp4a.u32.s32 (CUDA's __dp4a has no mixed-sign overload).
__device__ __forceinline__ int dp4a_us(uint a, int b, int c) {
#if defined(LILY_CUDA_SIM)
  uint r = (uint)c;
  for (int i = 0; i < 32; i += 8) r += (uint)((int)((a >> i) & 0xffu) * (int)(signed char)(b >> i));
  return (int)r;
#else
  int r;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#endif
}

// A hint that p's 128-byte line will be read soon: fetched into L2 (PTX prefetch.global.L2; no
// effect on results, none in the simulator).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if !defined(LILY_CUDA_SIM)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// ---------------------------------------------------------------- int8 activation planes (GEMV)
// The decode GEMVs of 4- and 8-bit weights multiply codes by integers (dp4a), not floats, as the
// CPU backend does (backend/cpu/int8.rs, whose argument carries over): each 16-byte weight chunk's
// EPC values of x (32 at 4 bits, 16 at 8; a chunk lies in one weight group) are written in fixed
// point as a 24-bit integer v = rint(x / u) per value, u = the chunk's unit, a power of two with
// max|x_chunk| / u in [2^22, 2^23) (so |v| <= 2^23 - 1 after a clamp of the one rounding edge), and
// stored as GEMV_PLANES = 3 byte planes of v + 2^23: plane 0 its top byte minus 128 (signed, |q| <=
// 128), planes 1 and 2 its middle and low bytes (unsigned, 0..255), so v = 2^16 q0 + 2^8 q1 + q2.
// The unit's exponent comes from the bits of max|x| and the bytes are gathered by byte
// permutations: a few instructions a value (the staging was about half of a decode GEMV's
// instructions when it rounded plane by plane). Per element the error is at most u / 2, one f32
// ulp of the chunk's largest value (<= 2^-23 max|x_chunk|): the GEMV stays within the f32
// tolerances of the reference. The scale is per chunk, a finer cut
// than the CPU's per weight group. The bias term of the affine form, b_g sum(x), uses the chunk's
// exact f32 sum. Per plane a chunk's dot product is an int32 (|sum| <= 32 * 15 * 255 = 122,400 at
// 4 bits, 16 * 255 * 255 = 1,040,400 at 8) started at DP4A_ZERO, the bits of the float 1.5 *
// 2^23: the sum stays below 2^22, so the bits read back as the float 1.5 * 2^23 + sum, and one
// subtraction converts it exactly (no int-to-float instruction, a quarter-rate one).
#define GEMV_PLANES 3
#define DP4A_ZERO 0x4b400000
#define DP4A_ZERO_F 12582912.0f
// Biased f32 exponent of max|x_chunk| below which a chunk's integer part is zero (max < 2^-104:
// its unit would not be a normal float); such x contributes only through the exact bias sum.
#define PLANE_MIN_EXP 23
// One chunk's planes as a lane reads them from shared memory: q[p][h] = plane p's bytes 16 h ..
// 16 h + 15 (H = EPC / 16 int4 a plane), d = the chunk's unit u (of the combined sum), sum = the
// f32 sum of the chunk's x.
template <int H> struct XPlanes {
  int4 q[GEMV_PLANES][H];
  float d, sum;
};
// A chunk's x as staged in f32 (the other formats): its q-th 4 floats at p + q * step.
struct XFloats {
  const float* p;
  uint step;
};
// The combined value of a chunk's plane sums a[p] (each started at DP4A_ZERO), in units of d:
// a0 256^2 + a1 256 + a2 (rounded to f32 once past 2^24: a relative 2^-24 of the chunk's sum).
__device__ __forceinline__ float planes_total(const int* a) {
  const float t0 = __int_as_float(a[0]) - DP4A_ZERO_F, t1 = __int_as_float(a[1]) - DP4A_ZERO_F,
              t2 = __int_as_float(a[2]) - DP4A_ZERO_F;
  return fmaf(t0, 65536.0f, fmaf(t1, 256.0f, t2));
}

// ---------------------------------------------------------------- activations
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// log(1 + e^x), linear above 20 like torch.
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
#define NEG_BIG (-3.402823466e38f)  // -FLT_MAX: a finite "minus infinity"
#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------- reductions
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}
// Sum of one value per thread over the block (blockDim.x a multiple of 32, <= 1024); every
// thread gets the result. `partial` holds 32 floats of shared memory; reached by every thread.
__device__ __forceinline__ float block_sum(float v, float* partial) {
  const uint lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float t = lane < nw ? partial[lane] : 0.0f;
  t = warp_sum(t);
  __syncthreads();  // partial is reused by the caller's next call
  return t;
}
__device__ __forceinline__ float block_max(float v, float* partial) {
  const uint lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  v = warp_max(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float t = lane < nw ? partial[lane] : NEG_BIG;
  t = warp_max(t);
  __syncthreads();
  return t;
}

// ---------------------------------------------------------------- weight readers
// Scales / biases of affine weights by element type.
// Scale / bias types of the affine formats: float, ushort (bf16) and Half (f16).
struct Half { ushort b; };
// A scale's stored bits (loaded, not yet converted) and their value: a GEMV's items keep the bits,
// so the conversion waits for the load only where the dot product needs the value. Converting at
// load time made each of a lane's 8 loads-ahead wait for its scale (a DRAM round trip) before the
// next item's loads were issued: the loads ahead were serialized (sm_90 SASS of the 4-bit GEMVs).
template <typename S> __device__ __forceinline__ uint scale_bits(const uchar* p, size_t i) {
  if constexpr (sizeof(S) == 4)
    return load_stream(reinterpret_cast<const uint*>(p) + i);
  else
    return load_stream(reinterpret_cast<const ushort*>(p) + i);
}
template <typename S> __device__ __forceinline__ float scale_value(uint bits);
template <> __device__ __forceinline__ float scale_value<float>(uint bits) { return __uint_as_float(bits); }
template <> __device__ __forceinline__ float scale_value<ushort>(uint bits) { return bf16_float((ushort)bits); }
template <> __device__ __forceinline__ float scale_value<Half>(uint bits) { return f16_float((ushort)bits); }
// Scale i, loaded and converted at once (the element paths, which use it where they load it).
template <typename S> __device__ __forceinline__ float load_scale(const uchar* p, size_t i) {
  return scale_value<S>(scale_bits<S>(p, i));
}

// Dense weights: E elements of type T (0 f32, 1 bf16, 2 f16) per row. EPC: elements per 16 bytes.
template <int KIND> struct DenseW {
  static constexpr int EPC = KIND == 0 ? 4 : 8;
  static constexpr bool PLANAR = false;  // x staged in f32 (gemv_staged)
  const uchar* w;
  CudaMatrix m;
  __device__ __forceinline__ static float elem(const uchar* p, size_t j) {
    if (KIND == 0) return reinterpret_cast<const float*>(p)[j];
    const ushort b = reinterpret_cast<const ushort*>(p)[j];
    return KIND == 1 ? bf16_float(b) : f16_float(b);
  }
  __device__ __forceinline__ float at(size_t row, uint j) const { return elem(w + row * m.row_bytes, j); }
  // Chunk c of stored row `row` as loaded (the GEMV issues these before it needs them: Item).
  struct Item { uint4 v; };
  __device__ __forceinline__ Item load(size_t row, uint c) const {
    return Item{load16(w + row * m.row_bytes + (size_t)c * 16)};
  }
  // Dot product of chunk c (columns c * EPC ..) of stored row `row` with the chunk's x, whose
  // q-th 4 floats are at xc + q * step (step 4: x contiguous; gemv_staged: a staged layout).
  __device__ __forceinline__ float dot(size_t row, uint c, const float* xc, uint step) const {
    return dot_item(row, load(row, c), c, xc, step);
  }
  __device__ __forceinline__ float dot_x(size_t row, const Item& it, uint c, const XFloats& x) const {
    return dot_item(row, it, c, x.p, x.step);
  }
  __device__ __forceinline__ float dot_item(size_t, const Item& it, uint, const float* xc, uint step) const {
    const uint4 v = it.v;
    const uint u[4] = {v.x, v.y, v.z, v.w};
    float acc = 0.0f;
    if (KIND == 0) {
      const float4 x = load_f4(xc);
      acc = __uint_as_float(u[0]) * x.x + __uint_as_float(u[1]) * x.y + __uint_as_float(u[2]) * x.z +
            __uint_as_float(u[3]) * x.w;
    } else {
      for (int i = 0; i < 4; i += 2) {
        const float4 x = load_f4(xc + (i / 2) * step);
        const ushort h[4] = {(ushort)u[i], (ushort)(u[i] >> 16), (ushort)u[i + 1], (ushort)(u[i + 1] >> 16)};
        float w4[4];
        for (int e = 0; e < 4; ++e) w4[e] = KIND == 1 ? bf16_float(h[e]) : f16_float(h[e]);
        acc += w4[0] * x.x + w4[1] * x.y + w4[2] * x.z + w4[3] * x.w;
      }
    }
    return acc;
  }
  // The tensor-core tiles (mma_tile) take any loaded item (item_whole) and stage it as EPC / 2 bf16x2
  // words: bf16 weights as they are, f32 / f16 rounded to nearest even.
  __device__ __forceinline__ bool item_whole() const { return true; }
  __device__ __forceinline__ void item_bf16(const Item& it, uint* out) const {
    const uint u[4] = {it.v.x, it.v.y, it.v.z, it.v.w};
    if (KIND == 0) {
      out[0] = pack_bf16x2(__uint_as_float(u[0]), __uint_as_float(u[1]));
      out[1] = pack_bf16x2(__uint_as_float(u[2]), __uint_as_float(u[3]));
    } else {
      for (int i = 0; i < 4; ++i)
        out[i] = KIND == 1 ? u[i] : pack_bf16x2(f16_float((ushort)u[i]), f16_float((ushort)(u[i] >> 16)));
    }
  }
};

// MLX affine weights: BITS-bit codes packed little-endian in u32 words per row; w = s q + b with
// one scale / bias (type S) per `group` columns (group % 8 == 0, cols % group == 0).
// A quantization code (< 2^23) as a float, exactly, without the int-to-float instruction.
__device__ __forceinline__ float code_float(uint q) { return __uint_as_float(0x4b000000u | q) - 8388608.0f; }

template <int BITS, typename S> struct AffineW {
  static constexpr int EPC = 128 / BITS;
  // 4- and 8-bit chunks take x as int8 planes in the staged GEMV (dot_x below); 2-bit keeps f32.
  static constexpr bool PLANAR = BITS == 4 || BITS == 8;
  const uchar* w;
  const uchar* scales;
  const uchar* biases;
  CudaMatrix m;
  __device__ __forceinline__ float at(size_t row, uint j) const {
    const uint* rw = reinterpret_cast<const uint*>(w + row * m.row_bytes);
    const uint bit = j * BITS;
    const uint q = (rw[bit / 32] >> (bit % 32)) & ((1u << BITS) - 1u);
    const size_t g = row * (m.cols / m.group) + j / m.group;
    return load_scale<S>(scales, g) * (float)q + load_scale<S>(biases, g);
  }
  // Dot product of chunk c (columns c * EPC ..) of stored row `row` with xc[0..EPC), as
  // s * sum(q x) + b * sum(x) per group: no dequantized weight is formed. A code becomes a float
  // by the exponent trick (2^23 + q has q in its mantissa; minus 2^23 is exact): the int-to-float
  // instruction runs at a quarter of the FMA rate and the H200 profile had the GEMVs bound by it.
  // With a power-of-two group, the group index is a shift (no division per chunk). x as DenseW::dot.
  // Chunk c of stored row `row` as loaded, with its group's scale and bias when the chunk lies in
  // one group (group % EPC == 0: the usual 4-bit / 8-bit g64; else dot_item reads them itself).
  // The scale and bias as stored bits (scale_bits): converted where the dot product uses them.
  struct Item {
    uint4 v;
    uint sb, bb;
    __device__ __forceinline__ float s() const { return scale_value<S>(sb); }
    __device__ __forceinline__ float b() const { return scale_value<S>(bb); }
  };
  __device__ __forceinline__ Item load(size_t row, uint c) const {
    Item it;
    it.v = load16(w + row * m.row_bytes + (size_t)c * 16);
    it.sb = it.bb = 0u;
    if (m.group % EPC == 0) {
      const uint j0 = c * EPC;
      const size_t g = m.group_shift != 0 ? row * (m.cols >> m.group_shift) + (j0 >> m.group_shift)
                                          : row * (m.cols / m.group) + j0 / m.group;
      it.sb = scale_bits<S>(scales, g);
      it.bb = scale_bits<S>(biases, g);
    }
    return it;
  }
  __device__ __forceinline__ float dot(size_t row, uint c, const float* xc, uint step) const {
    return dot_item(row, load(row, c), c, xc, step);
  }
  __device__ __forceinline__ float dot_x(size_t row, const Item& it, uint c, const XFloats& x) const {
    return dot_item(row, it, c, x.p, x.step);
  }
  // The chunk times its x planes (byte planes above; needs group % EPC == 0, so it.s / it.b are
  // the chunk's): s d (sum_p 256^(2 - p) codes . plane p) + b sum(x). 4 bits: a u32 of 8 codes
  // splits into its low nibbles (columns 0, 2, 4, 6 of the word, one per byte: w & 0x0f0f0f0f) and
  // its high ones (1, 3, 5, 7), which meet the planes' even / odd ints (the staging's order); 8
  // bits: a u32 is 4 codes in column order. Plane 0 is signed (dp4a with signed bytes), planes 1
  // and 2 unsigned (unsigned dp4a). One dp4a per 4 codes and plane: 3 planes, 32 codes: 24 dp4a +
  // 12 unpacking + 8 to combine, ~1.4 instructions a code (the f32 path: ~4.3).
  __device__ __forceinline__ float dot_x(size_t, const Item& it, uint, const XPlanes<EPC / 16>& x) const {
    static_assert(PLANAR, "dot_x on planes: 4- and 8-bit codes only");
    const uint u[4] = {it.v.x, it.v.y, it.v.z, it.v.w};
    int a[GEMV_PLANES];
#pragma unroll
    for (int p = 0; p < GEMV_PLANES; ++p) {
      int acc = DP4A_ZERO;
#pragma unroll
      for (int h = 0; h < EPC / 16; ++h) {
        const int4 q = x.q[p][h];
        const int qv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          // 4 bits: word 2h + k / 2, low nibbles for even k; 8 bits: word k.
          const uint w = BITS == 4 ? (u[2 * h + k / 2] >> (4 * (k % 2))) & 0x0f0f0f0fu : u[k];
          if (p == 0)
            acc = BITS == 4 ? __dp4a((int)w, qv[k], acc) : dp4a_us(w, qv[k], acc);
          else
            acc = (int)__dp4a(w, (uint)qv[k], (uint)acc);
        }
      }
      a[p] = acc;
    }
    return fmaf(it.s() * x.d, planes_total(a), it.b() * x.sum);
  }
  __device__ __forceinline__ float dot_item(size_t row, const Item& it, uint c, const float* xc, uint step) const {
    const uint4 v = it.v;
    const uint u[4] = {v.x, v.y, v.z, v.w};
    constexpr int PW = 32 / BITS;  // codes per word
    constexpr uint MASK = (1u << BITS) - 1u;
    const uint j0 = c * EPC;
    // Sums over each run of 8 columns (a group holds a whole number of them).
    float qx[EPC / 8], xs[EPC / 8];
    for (int k = 0; k < EPC / 8; ++k) qx[k] = xs[k] = 0.0f;
    for (int j = 0; j < EPC; j += 4) {
      const float4 x = load_f4(xc + (j / 4) * step);
      const uint word = u[j / PW], sh = (j % PW) * BITS;
      qx[j / 8] += code_float((word >> sh) & MASK) * x.x + code_float((word >> (sh + BITS)) & MASK) * x.y +
                   code_float((word >> (sh + 2 * BITS)) & MASK) * x.z +
                   code_float((word >> (sh + 3 * BITS)) & MASK) * x.w;
      xs[j / 8] += (x.x + x.y) + (x.z + x.w);
    }
    if (m.group % EPC == 0) {  // the whole chunk in one group (the usual case: 4-bit g64, 8-bit g64)
      float q = 0.0f, sx = 0.0f;
      for (int k = 0; k < EPC / 8; ++k) q += qx[k], sx += xs[k];
      return it.s() * q + it.b() * sx;
    }
    const size_t g0 = row * (m.cols / m.group);
    float acc = 0.0f;
    for (int k = 0; k < EPC / 8; ++k) {
      const size_t g = g0 + (j0 + 8 * k) / m.group;
      acc += load_scale<S>(scales, g) * qx[k] + load_scale<S>(biases, g) * xs[k];
    }
    return acc;
  }
  // The tensor-core tiles stage an item as EPC / 2 bf16x2 words of s q + b (codes by the exponent
  // trick, as dot_item), when it lies in one group (item_whole; else they read it by `at`).
  __device__ __forceinline__ bool item_whole() const { return m.group % EPC == 0; }
  __device__ __forceinline__ void item_bf16(const Item& it, uint* out) const {
    const uint u[4] = {it.v.x, it.v.y, it.v.z, it.v.w};
    constexpr int PW = 32 / BITS;  // codes per word
    constexpr uint MASK = (1u << BITS) - 1u;
    const float s = it.s(), b = it.b();
#pragma unroll
    for (int j = 0; j < EPC; j += 2) {
      const uint word = u[j / PW], sh = (j % PW) * BITS;
      out[j / 2] = pack_bf16x2(fmaf(s, code_float((word >> sh) & MASK), b),
                               fmaf(s, code_float((word >> (sh + BITS)) & MASK), b));
    }
  }
};

typedef DenseW<0> W_f32;
typedef DenseW<2> W_f16;
typedef DenseW<1> W_bf16;
typedef AffineW<2, ushort> W_q2_bf16;
typedef AffineW<4, ushort> W_q4_bf16;
typedef AffineW<8, ushort> W_q8_bf16;
typedef AffineW<2, Half> W_q2_f16;
typedef AffineW<4, Half> W_q4_f16;
typedef AffineW<8, Half> W_q8_f16;
typedef AffineW<2, float> W_q2_f32;
typedef AffineW<4, float> W_q4_f32;
typedef AffineW<8, float> W_q8_f32;
// Every weight format by host-name suffix (the order of WEIGHT_SUFFIXES in backend/cuda/kernels.rs).
#define FOR_EACH_WEIGHT(F) \
  F(f32) F(f16) F(bf16) F(q2_bf16) F(q4_bf16) F(q8_bf16) F(q2_f16) F(q4_f16) F(q8_f16) F(q2_f32) F(q4_f32) F(q8_f32)

// A weight reader over (w, scales, biases, desc); dense formats ignore scales and biases.
template <typename W> __device__ __forceinline__ W make_w(const uchar* w, const uchar* s, const uchar* b, CudaMatrix m);
#define DENSE_MAKE(T)                                                                                         \
  template <> __device__ __forceinline__ T make_w<T>(const uchar* w, const uchar*, const uchar*, CudaMatrix m) { \
    T r;                                                                                                      \
    r.w = w;                                                                                                  \
    r.m = m;                                                                                                  \
    return r;                                                                                                 \
  }
#define AFFINE_MAKE(T)                                                                                          \
  template <> __device__ __forceinline__ T make_w<T>(const uchar* w, const uchar* s, const uchar* b, CudaMatrix m) { \
    T r;                                                                                                        \
    r.w = w;                                                                                                    \
    r.scales = s;                                                                                               \
    r.biases = b;                                                                                               \
    r.m = m;                                                                                                    \
    return r;                                                                                                   \
  }
DENSE_MAKE(W_f32)
DENSE_MAKE(W_f16)
DENSE_MAKE(W_bf16)
AFFINE_MAKE(W_q2_bf16)
AFFINE_MAKE(W_q4_bf16)
AFFINE_MAKE(W_q8_bf16)
AFFINE_MAKE(W_q2_f16)
AFFINE_MAKE(W_q4_f16)
AFFINE_MAKE(W_q8_f16)
AFFINE_MAKE(W_q2_f32)
AFFINE_MAKE(W_q4_f32)
AFFINE_MAKE(W_q8_f32)

// acc[r] += the dot products of columns done .. K of the R stored rows rows[r] with x, element by
// element over the lanes of a warp (a row that is not 16-byte aligned, m.vec == 0, or a K tail).
// LG: the lanes that share the rows (a lane group: 32, or fewer for short rows, gemv_block).
template <typename W, int R, typename Row, uint LG = 32>
__device__ __forceinline__ void rows_dot_tail(const W& wr, const Row* rows, uint done, uint K,
                                              const float* __restrict__ x, float* acc) {
  for (uint j = done + threadIdx.x % LG; j < K; j += LG) {
    const float xj = x[j];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += wr.at(rows[r], j) * xj;
  }
}

// ---------------------------------------------------------------- staged GEMV (decode)
// The GEMV layout shared by matmul_gemv(_multi), moe_gate_up and moe_down: a block of 8 warps forms
// 8 / ks groups of rows (ks = 1, 2, 4 or 8, the host's choice: enough blocks to fill the GPU when
// rows are few); the ks warps of a group split K in steps of 32 16-byte chunks (warp s of the group
// takes steps s, s + ks, ..; lane l chunk l of a step: a warp reads 512 contiguous bytes of a row),
// and their partial sums meet in shared memory (gemv_combine). Short rows (16 chunks or fewer: the
// experts' down projection, K = 512 at 4 bits) split a warp into 32 / LG lane groups of LG lanes,
// each with its own rows, instead of leaving lanes without a chunk (gemv_block's LG).
// Latency, not bandwidth, bounds a decode GEMV (a few MB over 132 SMs), so a warp issues the weight
// loads of its first NC steps for all R rows (R x NC 16-byte loads a lane, with their scales and
// biases, into registers) BEFORE the block stages x: the weights' HBM round trip and x's L2 round
// trip overlap instead of following each other across the barrier. x is staged once per block in
// shared memory, transposed: piece q (4 floats) of chunk c at xs[(c / 32) * 32 Q + 32 q + c % 32]
// (Q = EPC / 4), so the 32 lanes reading piece q of chunks c .. c + 31 read 512 consecutive bytes
// (no bank conflict; read from global memory instead, those 32 lanes would touch 32 cache lines per
// load, 8 such loads a chunk at 4 bits).
#define GEMV_ROWS 4
// Blocks of 256 threads per SM the staged GEMV kernels ask the compiler for (__launch_bounds__'s
// second argument): 2 caps them at 128 registers a thread, so two blocks (16 warps, 2 x 8 rows of
// loads in flight) share an SM instead of one (the loads-ahead registers took the 4-bit GEMVs to
// 128-161). Not for 2-bit weights, whose 64-float x chunks need more: capped, they spill.
#define GEMV_MIN_BLOCKS(W) ((W::EPC) >= 64 ? 1 : 2)
// Floats of x a block stages per pass: 32 KiB, a multiple of 32 chunks of every format (EPC <= 64),
// so a pass covers whole 32-chunk steps; K of the model's matrices (<= 8192 at 4 bits) is one pass.
#define GEMV_XS 8192

// Whether x [K] of matrix m is staged in one pass of gemv_staged (so a block that loops over row
// groups stages it once): K's whole chunks fit GEMV_XS.
template <typename W> __device__ __forceinline__ bool gemv_one_pass(const CudaMatrix& m) {
  return m.cols / W::EPC <= GEMV_XS / W::EPC;
}

// The byte-plane staging of x (W::PLANAR formats: 4- and 8-bit, 16 or 32 columns a chunk; the
// planes' arithmetic is described above XPlanes) for the n chunks of x [n * EPC] of one pass, into
// the GEMV_XS-float buffer xs: plane p's int4 h of chunk c at int4 ((c / 32) 3 H + p H + h) 32 +
// c % 32 (H = EPC / 16: the 32 lanes reading chunks c .. c + 31 read 512 consecutive bytes), then
// (u, sum) of chunk c as float2 c after the SEG chunks' planes (SEG = GEMV_XS / EPC: 26 KiB at 4
// bits, 28 KiB at 8, of the 32 KiB). Thread mapping: piece f = 8 floats (columns 8 (f % P) .. of
// chunk f / P, P = EPC / 8 pieces a chunk) per thread and round; a chunk's P lanes meet by xor
// shuffles for its max |x| and sum (the same butterfly in every lane: the same bits whatever the
// order threads run in). A piece fills ints 2k and 2k + 1 of each plane (k = f % P), the bytes in
// the order dot_x reads them: at 8 bits column order (int 2k columns 0-3 of the piece, 2k + 1
// columns 4-7); at 4 bits a u32 of 8 codes splits into even / odd columns, so int 2k holds the
// piece's columns 0, 2, 4, 6 and int 2k + 1 the odd ones. Reached by every thread of the block
// (whole warps shuffle: rounds past the end run with zeros and store nothing).
template <int EPC>
__device__ __forceinline__ void gemv_stage_planes(const float* __restrict__ x, uint n, float4* xs) {
  constexpr uint P = EPC / 8, H = EPC / 16, SEG = GEMV_XS / EPC;
  uint2* qs = reinterpret_cast<uint2*>(xs);
  float* ds = reinterpret_cast<float*>(xs + SEG * GEMV_PLANES * H);
  const uint total = n * P;
  for (uint f0 = 0; f0 < total; f0 += blockDim.x) {
    const uint f = f0 + threadIdx.x, c = f / P, k = f % P;
    const bool real = f < total;  // the same for the P lanes of a chunk
    const float4 lo = real ? load_f4(x + (size_t)f * 8) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4 hi = real ? load_f4(x + (size_t)f * 8 + 4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float e[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(e[i]));
    float sum = ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
#pragma unroll
    for (uint o = 1; o < P; o <<= 1) {
      m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
      sum += __shfl_xor_sync(FULL_MASK, sum, o);
    }
    // max|x| in [2^(E - 127), 2^(E - 126)) for its biased exponent E: u = 2^(E - 127 - 22), so
    // x / u = x 2^(149 - E) has |x / u| < 2^23. fmaxf drops a NaN (then sum is NaN, and so is the
    // result); an infinite max (E = 255) still gives a normal scale.
    const int E = (int)(__float_as_uint(m) >> 23);
    const bool some = E >= PLANE_MIN_EXP;
    const float scale = some ? __uint_as_float((uint)(276 - E) << 23) : 0.0f;
    uint b[8];  // v + 2^23 in [0, 2^24): its three low bytes are the planes
#pragma unroll
    for (int i = 0; i < 8; ++i) b[i] = (uint)min(__float2int_rn(e[i] * scale), 8388607) + 8388608u;
    // Words A (the piece's first int of a plane) and B (its second), from the values in order
    // ia[0..4) / ib[0..4): 4 bits even / odd columns, 8 bits columns 0-3 / 4-7.
    const uint ia[4] = {b[0], EPC == 32 ? b[2] : b[1], EPC == 32 ? b[4] : b[2], EPC == 32 ? b[6] : b[3]};
    const uint ib[4] = {EPC == 32 ? b[1] : b[4], EPC == 32 ? b[3] : b[5], EPC == 32 ? b[5] : b[6], b[7]};
    const auto gather = [](const uint* v, int* out) {
      // byte j of v[0..4) for j = 2, 1, 0 (planes 0, 1, 2): pairs first, then the pairs' halves.
      const uint p01 = __byte_perm(v[0], v[1], 0x5140), p23 = __byte_perm(v[2], v[3], 0x5140);  // bytes 0, 1
      const uint h01 = __byte_perm(v[0], v[1], 0x0062), h23 = __byte_perm(v[2], v[3], 0x0062);  // byte 2
      out[0] = (int)(__byte_perm(h01, h23, 0x5410) ^ 0x80808080u);  // top byte - 128: signed
      out[1] = (int)__byte_perm(p01, p23, 0x7632);
      out[2] = (int)__byte_perm(p01, p23, 0x5410);
    };
    int wa[GEMV_PLANES], wb[GEMV_PLANES];
    gather(ia, wa);
    gather(ib, wb);
#pragma unroll
    for (int p = 0; p < GEMV_PLANES; ++p)
      if (real)
        qs[(((c / 32) * GEMV_PLANES * H + p * H + k / 2) * 32 + c % 32) * 2 + k % 2] =
            make_uint2((uint)wa[p], (uint)wb[p]);
    if (real && k == 0) {
      ds[2 * c] = some ? __uint_as_float((uint)(E - 22) << 23) : 0.0f;
      ds[2 * c + 1] = sum;
    }
  }
}
// Chunk c's planes and (d, sum) as gemv_stage_planes left them.
template <int EPC> __device__ __forceinline__ XPlanes<EPC / 16> gemv_planes_at(const float4* xs, uint c) {
  constexpr uint H = EPC / 16, SEG = GEMV_XS / EPC;
  XPlanes<H> x;
  const int4* qs = reinterpret_cast<const int4*>(xs);
#pragma unroll
  for (uint p = 0; p < GEMV_PLANES; ++p)
#pragma unroll
    for (uint h = 0; h < H; ++h) {
#if defined(LILY_CUDA_SIM)
      memcpy(&x.q[p][h], &qs[((c / 32) * GEMV_PLANES * H + p * H + h) * 32 + c % 32], 16);
#else
      x.q[p][h] = qs[((c / 32) * GEMV_PLANES * H + p * H + h) * 32 + c % 32];
#endif
    }
  const float* ds = reinterpret_cast<const float*>(xs + SEG * GEMV_PLANES * H);
  x.d = ds[2 * c];
  x.sum = ds[2 * c + 1];
  return x;
}

// For each pass over x [0, K) (only when `vec`: 16-byte aligned rows): load(r, c) the items
// (W::Item) of this warp's first NC chunks of each of its R rows (when `active`), stage x (f32, or
// int8 planes for W::PLANAR formats: gemv_stage_planes), then dot(r, item, c, xv) for each (xv:
// chunk c's x, XFloats or XPlanes, read from shared memory once for the R rows), then the next NC
// chunks, to the pass end. Reached by every thread of the block (it synchronizes). Returns the
// columns done (the caller does the tail K % EPC, or all of K when !vec, element by element:
// rows_dot_tail). R and NC are compile-time constants: the items live in registers. The planes need
// chunks inside one group (group % EPC == 0, true of MLX's groups 32, 64, 128): other groups of a
// PLANAR format take the element path (returns 0). It calls grid_dep_wait() after the first weight
// loads and before touching x, on every path: the caller may read x, and write, once it returns.
// `staged`: xs already holds this x from the block's previous call (the caller passes it only when
// K fits one pass, gemv_one_pass): the staging and its barrier are skipped.
// LG: lanes a row group (32; 16 or 8 for short rows: lane l takes chunks l % LG + LG i).
template <typename W, int R, int NC, typename Load, typename Dot, uint LG = 32>
__device__ __forceinline__ uint gemv_staged(const CudaMatrix& m, bool vec, uint K, const float* __restrict__ x,
                                            float4* xs, bool active, uint s, uint ks, Load load, Dot dot,
                                            bool staged = false) {
  constexpr uint EPC = W::EPC, Q = EPC / 4, SEG = GEMV_XS / EPC;
  if (!vec || (W::PLANAR && m.group % EPC != 0)) {
    grid_dep_wait();
    return 0;
  }
  typedef decltype(load(0, 0u)) Item;
  const uint chunks = K / EPC, stride = LG * ks;
  if (chunks == 0) grid_dep_wait();
  for (uint s0 = 0; s0 < chunks; s0 += SEG) {
    const uint n = min(SEG, chunks - s0), c1 = s0 + n;
    Item items[NC][R];
    const auto fetch = [&](uint c) {
#pragma unroll
      for (int i = 0; i < NC; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (active && c + i * stride < c1) items[i][r] = load(r, c + i * stride);
    };
    uint c = s0 + LG * s + threadIdx.x % LG;
    fetch(c);
    // Programmatic dependent launch: the first pass's weight loads (weights: never written by a
    // kernel) are in flight while the kernel before this one drains; x is read only after it.
    grid_dep_wait();
    if (staged) {
      // xs holds this pass already (one pass: s0 == 0); no thread writes it
    } else if constexpr (W::PLANAR) {
      gemv_stage_planes<EPC>(x + (size_t)s0 * EPC, n, xs);
    } else {
      for (uint f = threadIdx.x; f < n * Q; f += blockDim.x) {
        const uint cc = f / Q, q = f % Q;
        xs[(cc / 32) * 32 * Q + 32 * q + cc % 32] = load_f4(x + (size_t)(s0 + cc) * EPC + 4 * q);
      }
    }
    if (!staged) __syncthreads();
    if (active) {
      const float* xf = reinterpret_cast<const float*>(xs);
#pragma unroll 1
      while (c < c1) {
#pragma unroll
        for (int i = 0; i < NC; ++i) {
          const uint ci = c + i * stride;
          if (ci < c1) {
            if constexpr (W::PLANAR) {
              const XPlanes<EPC / 16> xv = gemv_planes_at<EPC>(xs, ci - s0);
#pragma unroll
              for (int r = 0; r < R; ++r) dot(r, items[i][r], ci, xv);
            } else {
              const XFloats xv{xf + 4 * (((ci - s0) / 32) * 32 * Q + (ci - s0) % 32), 128u};
#pragma unroll
              for (int r = 0; r < R; ++r) dot(r, items[i][r], ci, xv);
            }
          }
        }
        c += NC * stride;
        if (c < c1) fetch(c);
      }
    }
    __syncthreads();  // xs is refilled by the next pass
  }
  return chunks * EPC;
}

// The warp-summed partials v[0..R) of every warp into part[warp][..]; returns, for the first warp
// of each group (warp % ks == 0), the group's sums in v (the ks slices added in warp order).
// Reached by every thread of the block.
// With LG < 32 lanes a row group, each lane group is summed alone (the first lane of each holds
// its sums) and part has 8 * 32 / LG rows (slot: warp 32 / LG + lane / LG).
template <int R, uint LG = 32>
__device__ __forceinline__ void gemv_combine(float* v, float (*part)[R], uint ks) {
  constexpr uint G = 32 / LG;
  const uint warp = threadIdx.x / 32, slot = warp * G + threadIdx.x % 32 / LG;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (uint o = LG / 2; o > 0; o >>= 1) v[r] += __shfl_xor_sync(FULL_MASK, v[r], o);
  if (threadIdx.x % LG == 0)
#pragma unroll
    for (int r = 0; r < R; ++r) part[slot][r] = v[r];
  __syncthreads();
  if (warp % ks == 0)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float a = part[slot][r];
      for (uint j = 1; j < ks; ++j) a += part[slot + j * G][r];
      v[r] = a;
    }
}

// One block of the staged GEMV of matrix wr.m (N = m.rows, K = m.cols): out[r] = row r . x for the
// GEMV_ROWS rows of each of its 8 / ks warp groups (group g of block b owns rows (b (8 / ks) + g) 4
// .. + 4, stored rows base + r: base = row_offset (+ an expert's rows)); x [K], out [N] f32. A partial
// last group repeats its last row and stores only the valid ones. Accumulation: f32. NC: chunks a
// lane loads ahead per row (gemv_staged). xs (GEMV_XS floats) and part: the caller's shared memory;
// staged: xs holds this x already (gemv_staged). LG < 32 (short rows: gemv_lanes on the host):
// 32 / LG lane groups a warp, group j of warp group g owning rows ((b (8 / ks) + g) 32 / LG + j) 4
// .. + 4 (a block covers 32 / ks * 32 / LG rows), part with 8 * 32 / LG rows.
template <typename W, int NC, uint LG = 32, uint R = GEMV_ROWS>
__device__ __forceinline__ void gemv_block(const W& wr, size_t base, uint b, uint ks, const float* __restrict__ x,
                                           float* __restrict__ out, float4* xs, float (*part)[R],
                                           bool staged = false) {
  const CudaMatrix m = wr.m;
  const uint warp = threadIdx.x / 32, s = warp % ks, lane = threadIdx.x % 32;
  const uint r0 = ((b * (8 / ks) + warp / ks) * (32 / LG) + lane / LG) * R;
  const bool active = r0 < m.rows;  // whole lane group
  const uint nr = active ? min(R, m.rows - r0) : 1;
  uint rows[R];  // stored rows (< 2^32): half the registers of size_t
#pragma unroll
  for (uint r = 0; r < R; ++r) rows[r] = (uint)(base + r0 + min(r, nr - 1));
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const auto load = [&](int r, uint c) { return wr.load(rows[r], c); };
  const auto dot = [&](int r, const typename W::Item& it, uint c, const auto& xv) {
    acc[r] += wr.dot_x(rows[r], it, c, xv);
  };
  const uint done = gemv_staged<W, R, NC, decltype(load), decltype(dot), LG>(m, m.vec, m.cols, x, xs, active, s, ks,
                                                                            load, dot, staged);
  if (active && s == 0) rows_dot_tail<W, R, uint, LG>(wr, rows, done, m.cols, x, acc);
  gemv_combine<R, LG>(acc, part, ks);
  if (active && s == 0 && lane % LG == 0) {
#pragma unroll
    for (uint r = 0; r < R; ++r)
      if (r < nr) out[r0 + r] = acc[r];
  }
}

// ---------------------------------------------------------------- tensor-core tiles
// One output tile of 64 tokens x 128 weight rows of A W^T on the tensor cores, shared by the prefill
// GEMMs (matmul_mma, the grouped expert GEMMs of moe.cu). 256 threads = 8 warps, warp w owning tile
// rows (tokens) 32 (w / 4) .. + 32 and columns (weight rows) 32 (w % 4) .. + 32 as 2 x 4 m16n8
// accumulators. The 128 columns are two halves of 64: half h reads reader wh at stored rows rowh ..,
// the first nvh of them real (matmul: 128 consecutive rows of one matrix; the expert gate_up: 64 gate
// rows beside the same 64 rows of up, so both share the staged activations).
// Per K step of 64 the block stages A [64][64] (a_row(i): the f32 row of tile row i, or nullptr for a
// zero row), converted to bf16 once per block, and W [128][64] dequantized to bf16 in shared memory,
// rows padded to MMA_LD = 72 halves so the fragment reads of a warp hit 32 different banks, zero
// outside K; then 4 k16 steps of mma.sync m16n8k16 (bf16 inputs, f32 accumulation, fragments read
// straight from shared memory; layouts: tools/cuda-sim). The global loads of the NEXT K step (A as
// float4, W as 16-byte chunks with their scale and bias: MmaStage) are issued into registers before
// this step's mma, so their latency hides behind the tensor cores instead of following a barrier.
// Thread mapping of the staging: A float4 f = tid + 256 i (i < 4) is row f / 16, columns 4 (f % 16)
// (a warp reads 2 rows of 256 contiguous bytes); W chunk q = tid + 256 j is row q / CPR, chunk q % CPR.
// The host's copies: MMA_TOKENS, MMA_ROWS, MMA_THREADS in ops/matmul/cuda.rs (a test compares them).
#define MMA_T 64 // tokens of a tile (moe_sort's expert tiles have as many rows)
#define MMA_N 128 // weight rows of a tile: two halves of MMA_H
#define MMA_H 64 // weight rows of a half
#define MMA_K 64 // columns staged per K step
#define MMA_LD 72 // halves a staged row (64 + 8 padding: conflict-free fragment reads)
#define MMA_THREADS 256 // 8 warps
// Blocks per SM the tile kernels ask for (__launch_bounds__): 2 caps them at 128 registers a thread
// (4- and 2-bit weights: one 16-byte chunk a thread and K step); not for 8-bit or dense weights,
// whose next-step chunks take 12 to 32 registers more: capped, they spill (ptxas -v, sm_90).
#define MMA_MIN_BLOCKS(W) ((W::EPC) >= 32 ? 2 : 1)
#define MMA_SMEM ((MMA_T + MMA_N) * MMA_LD)  // halves of shared memory a tile stages (27 KiB)
__device__ __forceinline__ void mma_zero(float acc[2][4][4]) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
}
// The registers one thread loads for one K step ahead of its use.
template <typename W> struct MmaStage {
  static constexpr uint CPR = MMA_K / W::EPC;                                // W chunks per row and K step
  static constexpr uint NW = (MMA_N * CPR + MMA_THREADS - 1) / MMA_THREADS;  // W chunks per thread
  static constexpr uint NA = MMA_T * MMA_K / 4 / MMA_THREADS;                // A float4 per thread
  float4 a[NA];
  typename W::Item w[NW];
  uint loaded;  // bit j: w[j] was loaded whole (else it is staged element by element from `at`)
};
// The rare W chunks of mma_tile that are not loaded whole (a row past the matrix, the K tail, an
// unaligned row, a chunk across groups): element by element from `at`, zero outside the matrix, as
// bf16 pairs into dst. Not inlined: its code stays out of the hot loop's registers.
template <typename W>
__device__ __noinline__ void mma_chunk_slow(const W wr, size_t row, bool real, uint kc, uint K, uint* dst) {
  for (uint e = 0; e < (uint)W::EPC; e += 2) {
    const float lo = real && kc + e < K ? wr.at(row, kc + e) : 0.0f;
    const float hi = real && kc + e + 1 < K ? wr.at(row, kc + e + 1) : 0.0f;
    dst[e / 2] = pack_bf16x2(lo, hi);
  }
}
template <typename W, typename ARow>
__device__ __forceinline__ void mma_tile(const W& w0, size_t row0, uint nv0, const W& w1, size_t row1, uint nv1,
                                         uint K, ARow a_row, ushort* smem, float acc[2][4][4]) {
  typedef MmaStage<W> S;
  constexpr uint EPC = W::EPC, CPR = S::CPR;
  ushort* xs = smem;
  ushort* ws = smem + MMA_T * MMA_LD;
  const uint tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  const uint wt = (warp / 4) * 32, wn = (warp % 4) * 32;
  const bool a_vec = K % 4 == 0;  // A rows start 16-byte aligned
  const float* arow[S::NA];
#pragma unroll
  for (uint i = 0; i < S::NA; ++i) arow[i] = a_row(tid / 16 + 16 * i);
  // W chunk j of this thread: its reader, stored row and whether the row is real.
  auto w_of = [&](uint j, uint& c, size_t& row, bool& real) -> W {  // by value: no local copy of both
    const uint q = tid + MMA_THREADS * j, r = q / CPR, h = r / MMA_H, rr = r % MMA_H;
    c = q % CPR;
    row = (h ? row1 : row0) + rr;
    real = q < MMA_N * CPR && rr < (h ? nv1 : nv0);
    return h ? w1 : w0;
  };
  S st;
  auto fetch = [&](uint k0) {
#pragma unroll
    for (uint i = 0; i < S::NA; ++i) {
      const uint k = k0 + 4 * (tid % 16);
      const float* ar = arow[i];
      if (ar && a_vec && k < K) {
        st.a[i] = load_f4(ar + k);
      } else {
        st.a[i].x = ar && k < K ? ar[k] : 0.0f;
        st.a[i].y = ar && k + 1 < K ? ar[k + 1] : 0.0f;
        st.a[i].z = ar && k + 2 < K ? ar[k + 2] : 0.0f;
        st.a[i].w = ar && k + 3 < K ? ar[k + 3] : 0.0f;
      }
    }
    st.loaded = 0;
#pragma unroll
    for (uint j = 0; j < S::NW; ++j) {
      uint c;
      size_t row;
      bool real;
      const W wr = w_of(j, c, row, real);
      const uint kc = k0 + c * EPC;
      if (real && wr.m.vec && wr.item_whole() && kc + EPC <= K) {
        st.w[j] = wr.load(row, kc / EPC);
        st.loaded |= 1u << j;
      }
    }
  };
  fetch(0);
  for (uint k0 = 0; k0 < K; k0 += MMA_K) {
#pragma unroll
    for (uint i = 0; i < S::NA; ++i) {
      const uint f = tid + MMA_THREADS * i;
      uint2 p;
      p.x = pack_bf16x2(st.a[i].x, st.a[i].y);
      p.y = pack_bf16x2(st.a[i].z, st.a[i].w);
      *reinterpret_cast<uint2*>(&xs[(f / 16) * MMA_LD + 4 * (f % 16)]) = p;
    }
#pragma unroll
    for (uint j = 0; j < S::NW; ++j) {
      uint c;
      size_t row;
      bool real;
      const W wr = w_of(j, c, row, real);
      const uint q = tid + MMA_THREADS * j;
      if (q >= MMA_N * CPR) continue;
      uint* dst = reinterpret_cast<uint*>(&ws[(q / CPR) * MMA_LD + c * EPC]);
      if (st.loaded & (1u << j)) {
        uint words[EPC / 2];
        wr.item_bf16(st.w[j], words);
#pragma unroll
        for (uint e = 0; e < EPC / 2; e += 2) *reinterpret_cast<uint2*>(dst + e) = make_uint2(words[e], words[e + 1]);
      } else {
        mma_chunk_slow(wr, row, real, k0 + c * EPC, K, dst);
      }
    }
    __syncthreads();
    if (k0 + MMA_K < K) fetch(k0 + MMA_K);  // in flight during the mma below
#pragma unroll
    for (uint kk = 0; kk < MMA_K; kk += 16) {
      uint a[2][4], b[4][2];
#pragma unroll
      for (uint i = 0; i < 2; ++i) {
        const ushort* base = xs + (wt + 16 * i + g) * MMA_LD + kk + 2 * tq;
        a[i][0] = *reinterpret_cast<const uint*>(base);
        a[i][1] = *reinterpret_cast<const uint*>(base + 8 * MMA_LD);
        a[i][2] = *reinterpret_cast<const uint*>(base + 8);
        a[i][3] = *reinterpret_cast<const uint*>(base + 8 * MMA_LD + 8);
      }
#pragma unroll
      for (uint j = 0; j < 4; ++j) {
        const ushort* base = ws + (wn + 8 * j + g) * MMA_LD + kk + 2 * tq;
        b[j][0] = *reinterpret_cast<const uint*>(base);
        b[j][1] = *reinterpret_cast<const uint*>(base + 8);
      }
#pragma unroll
      for (uint i = 0; i < 2; ++i)
#pragma unroll
        for (uint j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
}
// Hand every element of this thread's accumulators to store(tile row, tile column, value).
template <typename Store>
__device__ __forceinline__ void mma_store(const float acc[2][4][4], Store store) {
  const uint warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  const uint wt = (warp / 4) * 32, wn = (warp % 4) * 32;
#pragma unroll
  for (uint i = 0; i < 2; ++i)
#pragma unroll
    for (uint j = 0; j < 4; ++j)
#pragma unroll
      for (uint e = 0; e < 4; ++e) store(wt + 16 * i + g + (e >= 2 ? 8 : 0), wn + 8 * j + 2 * tq + (e & 1), acc[i][j][e]);
}
