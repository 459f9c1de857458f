// cuda-sim: run CUDA C++ kernels on the CPU. Compile a .cu file as C++20 with
// `clang++-19 -x c++ -std=c++20 -DLILY_CUDA_SIM -include cuda_sim.h` after the textual lowering of
// `__shared__` declarations (crates/lily-core/src/backend/cuda/sim.rs `lower`, see README.md);
// link every object with one copy of the runtime (this header, compiled with -DCUDA_SIM_RUNTIME)
// into a shared library and launch kernels through the C ABI at the end of this file.
//
// Execution model: the blocks of a grid run one after another on the calling OS thread; the
// threads of a block run as ucontext fibers. A fiber runs until it reaches a synchronisation point
// (__syncthreads, a warp collective) or returns; when no fiber can run, the scheduler releases the
// barrier or the warp collective everyone waits at, or reports a deadlock / divergence:
//  - __syncthreads: released when every live thread of the block waits at one; threads that
//    returned count as arrived (as on the hardware);
//  - warp collectives (__shfl*_sync, __ballot_sync, __any/__all_sync, __syncwarp, mma): released
//    when the lanes waiting at the same call site are exactly the lanes of the mask that exist;
//    a lane of the mask that returned, waits elsewhere or never arrives is an error;
//  - shared memory (static and dynamic) is filled with 0xff bytes (NaN as float) at block start;
//  - device buffers made by cuda_sim_alloc end right before a PROT_NONE page: an access past the
//    end faults, and the launch returns an error naming the kernel, the argument that points
//    into that buffer, the byte offset, the block and the thread; dynamic shared memory too;
//  - CUDA_SIM_SCHED=reverse (or cuda_sim_set_schedule(1)) runs the fibers in reverse order.
#pragma once
#if !defined(LILY_CUDA_SIM)
#error "cuda_sim.h is the CPU stand-in for CUDA: compile with -DLILY_CUDA_SIM"
#endif

#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

// ---------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __grid_constant__

typedef unsigned int uint;

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
constexpr int warpSize = 32;

// ---------------------------------------------------------------- math (exact host versions)
using std::isfinite;
using std::isinf;
using std::isnan;
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : x > 1.f ? 1.f : x; }
inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
inline void sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
// Four byte products summed into c (PTX dp4a.s32.s32 / dp4a.u32.u32), wrapping like the GPU's.
inline int __dp4a(int a, int b, int c) {
  unsigned r = (unsigned)c;
  for (int i = 0; i < 32; i += 8) r += (unsigned)((int)(signed char)(a >> i) * (int)(signed char)(b >> i));
  return (int)r;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
  for (int i = 0; i < 32; i += 8) c += ((a >> i) & 0xffu) * ((b >> i) & 0xffu);
  return c;
}
// Bytes of the pair (y:x) picked by the selector's nibbles (x bytes 0-3, y 4-7; PTX prmt, default mode:
// only selectors 0-7 are used by the kernels).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = (unsigned long long)y << 32 | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}
// Round to nearest even, saturating; NaN -> 0 (PTX cvt.rni.s32.f32).
inline int __float2int_rn(float x) {
  if (x != x) return 0;
  const float r = rintf(x);
  return r >= 2147483648.0f ? 2147483647 : r < -2147483648.0f ? (-2147483647 - 1) : (int)r;
}
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
using std::max;
using std::min;
// CUDA's mixed-sign overloads (math_functions.h: the int converts to unsigned), which std::min /
// std::max lack: a kernel nvcc and NVRTC accept must compile here too.
inline unsigned min(int a, unsigned b) { return umin((unsigned)a, b); }
inline unsigned min(unsigned a, int b) { return umin(a, (unsigned)b); }
inline unsigned max(int a, unsigned b) { return umax((unsigned)a, b); }
inline unsigned max(unsigned a, int b) { return umax(a, (unsigned)b); }
template <class T> inline T __ldg(const T* p) { return *p; }

// ---------------------------------------------------------------- runtime interface
namespace cuda_sim {
enum { SLOT = 64 };  // bytes a lane publishes to a warp collective
struct Ids { uint3 thread, block, bdim, gdim; unsigned tid, lane, warp; };
const Ids& ids();
// Publish n bytes from this lane and wait for the lanes of `mask` at the same call site; returns
// the 32 slots of the warp (lane l's bytes at l * SLOT).
const unsigned char* warp_exchange(const void* v, unsigned n, unsigned mask, unsigned site, const char* op);
void sync_threads();
void* static_shared(size_t bytes, size_t align);
void* dynamic_shared();
unsigned live_lanes();  // lanes of the calling warp that exist (a partial last warp has fewer)
[[noreturn]] void fail(const char* msg);
}  // namespace cuda_sim

#define threadIdx (::cuda_sim::ids().thread)
#define blockIdx (::cuda_sim::ids().block)
#define blockDim (::cuda_sim::ids().bdim)
#define gridDim (::cuda_sim::ids().gdim)
#define CUDA_SIM_SITE unsigned _site = __builtin_LINE() * 4096u + __builtin_COLUMN()

// `__shared__ T name[N]...;` at kernel scope: lowered to CUDA_SIM_SHARED(T, name, [N]...).
// Every thread of the block reaches the same declarations in the same order, so the k-th
// declaration of each thread lands at the same place of the block's arena.
#define CUDA_SIM_SHARED(T, name, dims) \
  T(&name) dims = *reinterpret_cast<T(*) dims>(::cuda_sim::static_shared(sizeof(T dims), alignof(T)))
// `extern __shared__ T name[];`: lowered to CUDA_SIM_EXTERN_SHARED(T, name).
#define CUDA_SIM_EXTERN_SHARED(T, name) T* name = reinterpret_cast<T*>(::cuda_sim::dynamic_shared())

inline void __syncthreads() { ::cuda_sim::sync_threads(); }
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---------------------------------------------------------------- warp collectives
namespace cuda_sim {
template <class T> inline const T& lane_value(const unsigned char* slots, unsigned lane) {
  return *reinterpret_cast<const T*>(slots + (lane & 31u) * SLOT);
}
}  // namespace cuda_sim
inline void __syncwarp(unsigned mask = 0xffffffffu, CUDA_SIM_SITE) {
  unsigned z = 0;
  (void)::cuda_sim::warp_exchange(&z, 4, mask, _site, "__syncwarp");
}
// width: sub-warp segments as on the hardware (a power of two <= 32).
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32, CUDA_SIM_SITE) {
  static_assert(sizeof(T) <= cuda_sim::SLOT, "shuffle value too large");
  const unsigned char* s = ::cuda_sim::warp_exchange(&v, sizeof(T), mask, _site, "__shfl_sync");
  const unsigned lane = ::cuda_sim::ids().lane, base = lane & ~(unsigned)(width - 1);
  return ::cuda_sim::lane_value<T>(s, base + ((unsigned)src & (unsigned)(width - 1)));
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, CUDA_SIM_SITE) {
  const unsigned char* s = ::cuda_sim::warp_exchange(&v, sizeof(T), mask, _site, "__shfl_xor_sync");
  const unsigned lane = ::cuda_sim::ids().lane, src = lane ^ (unsigned)lane_mask;
  // a source outside the lane's segment returns the lane's own value
  return (src & ~(unsigned)(width - 1)) == (lane & ~(unsigned)(width - 1)) ? ::cuda_sim::lane_value<T>(s, src) : v;
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, CUDA_SIM_SITE) {
  const unsigned char* s = ::cuda_sim::warp_exchange(&v, sizeof(T), mask, _site, "__shfl_down_sync");
  const unsigned lane = ::cuda_sim::ids().lane, seg = lane & (unsigned)(width - 1);
  return seg + delta < (unsigned)width ? ::cuda_sim::lane_value<T>(s, lane + delta) : v;
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32, CUDA_SIM_SITE) {
  const unsigned char* s = ::cuda_sim::warp_exchange(&v, sizeof(T), mask, _site, "__shfl_up_sync");
  const unsigned lane = ::cuda_sim::ids().lane, seg = lane & (unsigned)(width - 1);
  return seg >= delta ? ::cuda_sim::lane_value<T>(s, lane - delta) : v;
}
inline unsigned __ballot_sync(unsigned mask, int pred, CUDA_SIM_SITE) {
  int p = pred != 0;
  const unsigned char* s = ::cuda_sim::warp_exchange(&p, 4, mask, _site, "__ballot_sync");
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && ::cuda_sim::lane_value<int>(s, l)) r |= 1u << l;
  return r;
}
// redux.sync: every lane of mask gets the max / min of their values.
inline unsigned __reduce_max_sync(unsigned mask, unsigned v, CUDA_SIM_SITE) {
  const unsigned char* s = ::cuda_sim::warp_exchange(&v, 4, mask, _site, "__reduce_max_sync");
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l)
    if (mask >> l & 1u) r = ::cuda_sim::lane_value<unsigned>(s, l) > r ? ::cuda_sim::lane_value<unsigned>(s, l) : r;
  return r;
}
inline unsigned __reduce_min_sync(unsigned mask, unsigned v, CUDA_SIM_SITE) {
  const unsigned char* s = ::cuda_sim::warp_exchange(&v, 4, mask, _site, "__reduce_min_sync");
  unsigned r = 0xffffffffu;
  for (unsigned l = 0; l < 32; ++l)
    if (mask >> l & 1u) r = ::cuda_sim::lane_value<unsigned>(s, l) < r ? ::cuda_sim::lane_value<unsigned>(s, l) : r;
  return r;
}
inline int __any_sync(unsigned mask, int pred, CUDA_SIM_SITE) { return __ballot_sync(mask, pred, _site) != 0; }
inline int __all_sync(unsigned mask, int pred, CUDA_SIM_SITE) {
  return __ballot_sync(mask, pred, _site) == (mask & ::cuda_sim::live_lanes());
}

// ---------------------------------------------------------------- atomics
// Fibers of one launch switch only at synchronisation points, so a read-modify-write is atomic.
template <class T> inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <class T> inline T atomicMax(T* p, T v) { T o = *p; *p = o > v ? o : v; return o; }
template <class T> inline T atomicMin(T* p, T v) { T o = *p; *p = o < v ? o : v; return o; }
template <class T> inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { T o = *p; if (o == cmp) *p = v; return o; }
template <class T> inline T atomicOr(T* p, T v) { T o = *p; *p = o | v; return o; }

// ---------------------------------------------------------------- emulated PTX
namespace cuda_sim {
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 as a warp collective, with the fragment
// layouts of the PTX ISA (groupID g = lane / 4, t = lane % 4):
//   A 16x16 row-major, 4 regs of bf16x2: reg 0 = (row g, cols 2t, 2t+1), 1 = (g + 8, 2t..),
//     2 = (g, 2t + 8..), 3 = (g + 8, 2t + 8..); the low half holds the lower column;
//   B 16x8 "col", 2 regs: reg 0 = (rows 2t, 2t+1, col g), reg 1 = (rows 2t + 8, 2t + 9, col g);
//   C/D 16x8 f32, 4 regs: (g, 2t), (g, 2t+1), (g + 8, 2t), (g + 8, 2t+1).
// Products of bf16 values are exact in f32; the sum runs over k in order, then adds C.
inline float bf16_bits_to_float(unsigned short b) { return __uint_as_float((unsigned)b << 16); }
inline void mma_m16n8k16_bf16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4], unsigned site) {
  struct Frag { unsigned a[4], b[2]; float c[4]; } mine;
  for (int i = 0; i < 4; ++i) mine.a[i] = a[i], mine.c[i] = c[i];
  mine.b[0] = b[0], mine.b[1] = b[1];
  const unsigned char* s = warp_exchange(&mine, sizeof mine, 0xffffffffu, site, "mma.sync.m16n8k16");
  auto A = [&](unsigned r, unsigned k) {
    const Frag& f = lane_value<Frag>(s, (r % 8) * 4 + (k % 8) / 2);
    const unsigned reg = (r >= 8 ? 1u : 0u) + (k >= 8 ? 2u : 0u);
    return bf16_bits_to_float((unsigned short)(f.a[reg] >> (16 * (k & 1))));
  };
  auto B = [&](unsigned k, unsigned n) {
    const Frag& f = lane_value<Frag>(s, n * 4 + (k % 8) / 2);
    return bf16_bits_to_float((unsigned short)(f.b[k >= 8 ? 1 : 0] >> (16 * (k & 1))));
  };
  const unsigned lane = ids().lane, g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const unsigned r = g + (i >= 2 ? 8 : 0), n = 2 * t + (i & 1);
    float acc = 0.0f;
    for (unsigned k = 0; k < 16; ++k) acc += A(r, k) * B(k, n);
    d[i] = c[i] + acc;
  }
}
}  // namespace cuda_sim

// ---------------------------------------------------------------- kernel export
namespace cuda_sim {
typedef void (*Body)(void*);
// Run the current launch (grid, block, shared bytes set by cuda_sim_launch) with `body(ctx)` as
// every thread's code.
void run_grid(Body body, void* ctx);
template <class... A, size_t... I>
inline void invoke_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
  struct Ctx { void (*f)(A...); std::tuple<std::decay_t<A>...> v; };
  Ctx c{f, std::tuple<std::decay_t<A>...>{*static_cast<std::decay_t<A>*>(args[I])...}};
  run_grid([](void* p) { Ctx* c = static_cast<Ctx*>(p); std::apply(c->f, c->v); }, &c);
}
template <class... A> inline void invoke(void (*f)(A...), void** args) {
  invoke_impl(f, args, std::index_sequence_for<A...>{});
}
}  // namespace cuda_sim
// The kernel `name` under the C symbol cuda_sim_kernel_<name>(void** args) (args as cuLaunchKernel).
#define CUDA_SIM_EXPORT(name) \
  extern "C" __attribute__((visibility("default"))) void cuda_sim_kernel_##name(void** args) { ::cuda_sim::invoke(&name, args); }

// ---------------------------------------------------------------- C ABI (runtime side)
extern "C" {
// A zeroed device buffer of `bytes` whose last byte sits right before a PROT_NONE page; `label`
// (copied) names it in error messages. NULL when out of memory.
void* cuda_sim_alloc(size_t bytes, const char* label);
void cuda_sim_free(void* p);
// Run kernel `fn` (a cuda_sim_kernel_<name> symbol) over grid x block threads with `shared_bytes`
// of dynamic shared memory; args[i] points to the value of parameter i. 0 on success; otherwise
// -1 and cuda_sim_last_error() says what went wrong (deadlock, divergent collective, fault).
int cuda_sim_launch(void (*fn)(void**), const unsigned grid[3], const unsigned block[3], unsigned shared_bytes,
                    void** args, const char* name);
const char* cuda_sim_last_error(void);
// Fiber order of this OS thread's next launches: -1 as CUDA_SIM_SCHED says, 0 forward, 1 reverse.
void cuda_sim_set_schedule(int mode);
}

#if defined(CUDA_SIM_RUNTIME)
// ================================================================ runtime (one copy per library)
namespace cuda_sim {
enum State { READY, WAIT_BLOCK, WAIT_WARP, DONE };
struct Fiber {
  ucontext_t uc;
  State st;
  unsigned site, mask, nbytes;
  const char* op;
  size_t shared_cursor;
  Ids ids;
  alignas(16) unsigned char slot[SLOT];
};
struct Buffer { char* base; size_t total; char* data; size_t bytes; char label[64]; };
constexpr size_t STATIC_SHARED = 48 * 1024;  // the CUDA limit of static shared memory per block
constexpr size_t PAGE = 4096;
struct Launch {
  Body body = nullptr;
  void* ctx = nullptr;
  unsigned grid[3], block[3], shared_bytes = 0;
  void** args = nullptr;
  int nargs = 0;
  const char* name = "?";
  Fiber* f = nullptr;
  unsigned nf = 0;
  int cur = -1;
  ucontext_t sched;
  char* stacks = nullptr;
  size_t stack_sz = 128 * 1024;
  char* static_arena = nullptr;
  char* dyn_base = nullptr;  // mapping of the dynamic shared memory (+ guard page)
  size_t dyn_total = 0;
  char* dyn = nullptr;
  alignas(16) unsigned char snap[32][32 * SLOT];
  bool reverse = false;
  char err[512];
  sigjmp_buf jump;
  bool armed = false;
};
inline thread_local Launch* g_launch = nullptr;
inline thread_local int g_schedule = -1;
inline thread_local char g_error[1024];
inline Buffer* g_bufs = nullptr;  // registry of live device buffers (host side, any thread)
inline size_t g_nbufs = 0, g_capbufs = 0;

inline Fiber& me() { return g_launch->f[g_launch->cur]; }
const Ids& ids() { return me().ids; }
unsigned live_lanes() {
  const Launch& L = *g_launch;
  const unsigned w0 = me().ids.warp * 32;
  const unsigned n = L.nf - w0 < 32 ? L.nf - w0 : 32;
  return n == 32 ? 0xffffffffu : (1u << n) - 1u;
}
[[noreturn]] void fail(const char* msg) {
  snprintf(g_launch->err, sizeof g_launch->err, "%s", msg);
  siglongjmp(g_launch->jump, 1);
}
inline void yield() { swapcontext(&me().uc, &g_launch->sched); }
void sync_threads() {
  me().st = WAIT_BLOCK;
  yield();
}
const unsigned char* warp_exchange(const void* v, unsigned n, unsigned mask, unsigned site, const char* op) {
  Fiber& f = me();
  memcpy(f.slot, v, n);
  f.st = WAIT_WARP;
  f.site = site;
  f.mask = mask;
  f.op = op;
  yield();
  return g_launch->snap[f.ids.warp];
}
void* static_shared(size_t bytes, size_t align) {
  Fiber& f = me();
  size_t at = (f.shared_cursor + align - 1) / align * align;
  if (at + bytes > STATIC_SHARED) fail("static __shared__ memory over 48 KiB");
  f.shared_cursor = at + bytes;
  return g_launch->static_arena + at;
}
void* dynamic_shared() { return g_launch->dyn; }

inline void entry() {
  g_launch->body(g_launch->ctx);
  me().st = DONE;
}

// Release what every waiting fiber of the block waits for; false (with err set) on a deadlock.
inline bool release(Launch& L) {
  const unsigned n = L.nf, nw = (n + 31) / 32;
  bool any_alive = false, released = false, all_block = true;
  for (unsigned w = 0; w < nw; ++w) {
    const unsigned lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
    const unsigned live = hi - lo == 32 ? 0xffffffffu : (1u << (hi - lo)) - 1u;
    int first = -1;
    for (unsigned t = lo; t < hi; ++t) {
      if (L.f[t].st != DONE) any_alive = true;
      if (L.f[t].st == WAIT_WARP && first < 0) first = (int)t;
      if (L.f[t].st != DONE && L.f[t].st != WAIT_BLOCK) all_block = false;
    }
    if (first < 0) continue;
    const Fiber& f0 = L.f[first];
    const unsigned want = f0.mask & live;
    unsigned here = 0;
    for (unsigned t = lo; t < hi; ++t)
      if (L.f[t].st == WAIT_WARP && L.f[t].site == f0.site) here |= 1u << (t - lo);
    if (here != want) {
      // Lanes of the mask still running may yet arrive: only when nobody can run is it an error
      // (the caller calls release only then).
      unsigned missing = want & ~here, extra = here & ~want;
      snprintf(L.err, sizeof L.err,
               "%s: warp %u of block (%u,%u,%u): mask 0x%08x, lanes at this call 0x%08x (missing 0x%08x%s%s)",
               f0.op, w, f0.ids.block.x, f0.ids.block.y, f0.ids.block.z, f0.mask, here, missing,
               extra ? ", lanes not in the mask 0x" : "", "");
      if (extra) {
        size_t k = strlen(L.err);
        snprintf(L.err + k, sizeof L.err - k, "%08x)", extra);
      } else {
        size_t k = strlen(L.err);
        snprintf(L.err + k, sizeof L.err - k, ")");
      }
      for (unsigned t = lo; t < hi; ++t)
        if ((missing >> (t - lo) & 1u) && L.f[t].st == DONE) {
          size_t k = strlen(L.err);
          snprintf(L.err + k, sizeof L.err - k, "; lane %u returned", t - lo);
          break;
        }
      return false;
    }
    for (unsigned t = lo; t < hi; ++t)
      if (here >> (t - lo) & 1u) {
        memcpy(L.snap[w] + (t - lo) * SLOT, L.f[t].slot, SLOT);
        L.f[t].st = READY;
      }
    released = true;
  }
  if (!any_alive) return true;
  if (released) return true;
  if (all_block) {
    for (unsigned t = 0; t < n; ++t)
      if (L.f[t].st == WAIT_BLOCK) L.f[t].st = READY;
    return true;
  }
  snprintf(L.err, sizeof L.err, "deadlock: threads wait at __syncthreads and at warp collectives at once");
  return false;
}

inline bool run_block(Launch& L, uint3 block) {
  const unsigned n = L.nf;
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = L.f[t];
    f.st = READY;
    f.shared_cursor = 0;
    f.ids.thread = {t % L.block[0], (t / L.block[0]) % L.block[1], t / (L.block[0] * L.block[1])};
    f.ids.block = block;
    f.ids.bdim = {L.block[0], L.block[1], L.block[2]};
    f.ids.gdim = {L.grid[0], L.grid[1], L.grid[2]};
    f.ids.tid = t;
    f.ids.lane = t % 32;
    f.ids.warp = t / 32;
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = L.stacks + (size_t)t * L.stack_sz;
    f.uc.uc_stack.ss_size = L.stack_sz;
    f.uc.uc_link = &L.sched;
    makecontext(&f.uc, (void (*)())entry, 0);
  }
  memset(L.static_arena, 0xff, STATIC_SHARED);
  if (L.shared_bytes) memset(L.dyn, 0xff, L.shared_bytes);
  for (;;) {
    bool ran = false;
    for (unsigned i = 0; i < n; ++i) {
      const unsigned t = L.reverse ? n - 1 - i : i;
      if (L.f[t].st == READY) {
        L.cur = (int)t;
        swapcontext(&L.sched, &L.f[t].uc);
        ran = true;
      }
    }
    if (ran) continue;
    bool alive = false;
    for (unsigned t = 0; t < n; ++t) alive |= L.f[t].st != DONE;
    if (!alive) return true;
    if (!release(L)) return false;
  }
}

void run_grid(Body body, void* ctx) {
  Launch& L = *g_launch;
  L.body = body;
  L.ctx = ctx;
  for (unsigned z = 0; z < L.grid[2]; ++z)
    for (unsigned y = 0; y < L.grid[1]; ++y)
      for (unsigned x = 0; x < L.grid[0]; ++x)
        if (!run_block(L, {x, y, z})) {
          size_t k = strlen(L.err);
          snprintf(L.err + k, sizeof L.err - k, " [block (%u,%u,%u)]", x, y, z);
          siglongjmp(L.jump, 1);
        }
}

inline void on_fault(int sig, siginfo_t* si, void*) {
  Launch* L = g_launch;
  if (!L || !L->armed) {
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  char* a = (char*)si->si_addr;
  const Ids* who = L->cur >= 0 ? &L->f[L->cur].ids : nullptr;
  char where[160] = "";
  if (who)
    snprintf(where, sizeof where, "block (%u,%u,%u) thread (%u,%u,%u)", who->block.x, who->block.y, who->block.z,
             who->thread.x, who->thread.y, who->thread.z);
  if (L->dyn_base && a >= L->dyn_base && a < L->dyn_base + L->dyn_total) {
    snprintf(L->err, sizeof L->err, "kernel %s: out-of-bounds access to dynamic shared memory at byte %ld of %u, %s",
             L->name, (long)(a - L->dyn), L->shared_bytes, where);
    siglongjmp(L->jump, 1);
  }
  for (size_t i = 0; i < g_nbufs; ++i) {
    Buffer& B = g_bufs[i];
    if (a >= B.base && a < B.base + B.total) {
      int arg = -1;
      for (int j = 0; j < L->nargs; ++j) {
        char* p;
        memcpy(&p, L->args[j], sizeof p);  // only meaningful for pointer arguments
        if (p >= B.data && p <= B.data + B.bytes) arg = j;
      }
      snprintf(L->err, sizeof L->err,
               "kernel %s: out-of-bounds access to buffer '%s' (argument %d, %zu bytes) at byte offset %ld, %s",
               L->name, B.label, arg, B.bytes, (long)(a - B.data), where);
      siglongjmp(L->jump, 1);
    }
  }
  snprintf(L->err, sizeof L->err, "kernel %s: invalid address %p, %s", L->name, (void*)a, where);
  siglongjmp(L->jump, 1);
}
}  // namespace cuda_sim

extern "C" {
__attribute__((visibility("default"))) void* cuda_sim_alloc(size_t bytes, const char* label) {
  using namespace cuda_sim;
  const size_t body = (bytes + PAGE - 1) / PAGE * PAGE;
  const size_t total = body + PAGE;
  char* base = (char*)mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  mprotect(base + body, PAGE, PROT_NONE);
  if (g_nbufs == g_capbufs) {
    g_capbufs = g_capbufs ? 2 * g_capbufs : 256;
    g_bufs = (Buffer*)realloc(g_bufs, g_capbufs * sizeof(Buffer));
  }
  Buffer& B = g_bufs[g_nbufs++];
  B.base = base;
  B.total = total;
  B.bytes = bytes;
  B.data = base + body - bytes;  // the last byte touches the guard page
  snprintf(B.label, sizeof B.label, "%s", label ? label : "");
  return B.data;
}
__attribute__((visibility("default"))) void cuda_sim_free(void* p) {
  using namespace cuda_sim;
  for (size_t i = 0; i < g_nbufs; ++i)
    if (g_bufs[i].data == p) {
      munmap(g_bufs[i].base, g_bufs[i].total);
      g_bufs[i] = g_bufs[--g_nbufs];
      return;
    }
}
__attribute__((visibility("default"))) const char* cuda_sim_last_error(void) { return cuda_sim::g_error; }
__attribute__((visibility("default"))) void cuda_sim_set_schedule(int mode) { cuda_sim::g_schedule = mode; }
__attribute__((visibility("default"))) int cuda_sim_launch(void (*fn)(void**), const unsigned grid[3],
                                                             const unsigned block[3], unsigned shared_bytes,
                                                             void** args, const char* name) {
  using namespace cuda_sim;
  const unsigned n = block[0] * block[1] * block[2];
  if (n == 0 || n > 1024 || grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535) {
    snprintf(g_error, sizeof g_error, "kernel %s: invalid launch grid (%u,%u,%u) block (%u,%u,%u)", name, grid[0],
             grid[1], grid[2], block[0], block[1], block[2]);
    return -1;
  }
  if (shared_bytes > 227 * 1024) {
    snprintf(g_error, sizeof g_error, "kernel %s: %u bytes of dynamic shared memory (at most 227 KiB)", name,
             shared_bytes);
    return -1;
  }
  static bool handlers = false;
  if (!handlers) {
    static char altstack[1 << 16];
    stack_t ss;
    ss.ss_sp = altstack;
    ss.ss_size = sizeof altstack;
    ss.ss_flags = 0;
    sigaltstack(&ss, nullptr);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
    handlers = true;
  }
  Launch* L = new Launch();
  for (int i = 0; i < 3; ++i) L->grid[i] = grid[i], L->block[i] = block[i];
  L->shared_bytes = shared_bytes;
  L->args = args;
  int nargs = 0;
  while (args && args[nargs]) ++nargs;  // the host passes a NULL-terminated array
  L->nargs = nargs;
  L->name = name;
  L->nf = n;
  L->f = new Fiber[n];
  L->stacks = (char*)mmap(nullptr, L->stack_sz * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                          -1, 0);
  L->static_arena = (char*)aligned_alloc(64, STATIC_SHARED);
  L->dyn_total = (shared_bytes + PAGE - 1) / PAGE * PAGE + PAGE;
  L->dyn_base = (char*)mmap(nullptr, L->dyn_total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  mprotect(L->dyn_base + L->dyn_total - PAGE, PAGE, PROT_NONE);
  L->dyn = L->dyn_base + L->dyn_total - PAGE - shared_bytes;
  const char* env = getenv("CUDA_SIM_SCHED");
  L->reverse = g_schedule >= 0 ? g_schedule == 1 : (env && !strcmp(env, "reverse"));
  L->err[0] = 0;
  Launch* prev = g_launch;
  g_launch = L;
  int rc = 0;
  if (sigsetjmp(L->jump, 1) == 0) {
    L->armed = true;
    fn(args);
  } else {
    rc = -1;
    snprintf(g_error, sizeof g_error, "%s%s%s", strstr(L->err, name) ? "" : "kernel ", strstr(L->err, name) ? "" : name,
             strstr(L->err, name) ? L->err : "");
    if (!strstr(L->err, name)) {
      size_t k = strlen(g_error);
      snprintf(g_error + k, sizeof g_error - k, ": %s", L->err);
    }
  }
  L->armed = false;
  g_launch = prev;
  munmap(L->stacks, L->stack_sz * n);
  munmap(L->dyn_base, L->dyn_total);
  free(L->static_arena);
  delete[] L->f;
  delete L;
  return rc;
}
}
#endif  // CUDA_SIM_RUNTIME
