// mtl_prelude.h -- a small, self-written stand-in for <metal_stdlib> so that
// Metal Shading Language compute kernels can be compiled by upstream clang
// (clang-19) on Linux.
//
// Three modes, chosen by macros:
//   (default)          CHECK: plain C++20, Metal address spaces mapped to clang's
//                      opencl_* address-space attributes (no generic space), so
//                      mixing device/threadgroup/constant/thread pointers is a
//                      type error.  Use with -fsyntax-only.
//   -DMTL_EXEC         EXEC:  address spaces erased; every threadgroup runs its
//                      threads as ucontext fibers on one OS thread; barriers and
//                      simd_* collectives are emulated exactly (32-wide simdgroups).
//   __OPENCL_CPP_VERSION__ (clang -x clcpp): CHECK with native OpenCL address
//                      spaces (generic pointers allowed, kernel-scope __local ok).
//
// Kernel parameter attributes ([[buffer(i)]], [[thread_position_in_grid]], ...)
// are macros.  In the C++ modes they expand to  ]] = <binder>, auto... <uniq> [[
// i.e. each attributed parameter gets a default argument that fetches its value
// from the dispatch context, followed by an empty function-parameter pack (legal
// after a defaulted parameter).  A kernel can therefore be called as `k()`, and
// the binder's conversion operators type-check the parameter type the way the
// Metal compiler does (positions must be uint/ushort vectors, buffers must point
// to device/constant memory, ...).
#pragma once
#pragma clang diagnostic ignored "-Wuser-defined-literals"
#pragma clang diagnostic ignored "-Wduplicate-decl-specifier"

#if defined(MTL_EXEC)
#include <ucontext.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/mman.h>
#include <signal.h>
#include <unistd.h>
#endif

#if defined(__OPENCL_CPP_VERSION__)
#define MTL_CLCPP 1
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#endif

// ---------------------------------------------------------------- address spaces
#if defined(MTL_EXEC)
#define device
#define constant const
#define threadgroup
#define thread
#define MTL_AS_DEVICE
#define MTL_AS_CONSTANT
#define MTL_AS_THREADGROUP
#define MTL_TG_VAR static thread_local
#elif defined(MTL_CLCPP)
#define device __global
#define constant __constant
#define threadgroup __local
#define thread __private
#define MTL_AS_DEVICE __global
#define MTL_AS_CONSTANT __constant
#define MTL_AS_THREADGROUP __local
#define MTL_TG_VAR __local
#else
#define MTL_AS_DEVICE __attribute__((opencl_global))
#define MTL_AS_CONSTANT __attribute__((opencl_constant))
#define MTL_AS_THREADGROUP __attribute__((opencl_local))
#define device MTL_AS_DEVICE
#define constant const MTL_AS_CONSTANT
#define threadgroup MTL_AS_THREADGROUP
#define thread
#define MTL_TG_VAR static MTL_AS_THREADGROUP
#endif
#define threadgroup_imageblock threadgroup

#if defined(MTL_CLCPP)
#define kernel __kernel
#else
#define kernel
#endif
#define METAL_FUNC inline

// ---------------------------------------------------------------- scalar types
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef decltype(sizeof(0)) size_t;
typedef long ptrdiff_t;
// -DMTL_NO_BFLOAT: Metal Shading Language 3.0 (macOS 13), which has no `bfloat` (MSL 3.1): every
// use of the type, its vectors and its simdgroup matrix is then an undeclared name.
#if defined(MTL_CLCPP)
#if !defined(MTL_NO_BFLOAT)
typedef ushort bfloat;  // spir64 has no __bf16: storage-only stand-in, arithmetic is NOT checked
#endif
#else
typedef _Float16 half;
#if !defined(MTL_NO_BFLOAT)
typedef __bf16 bfloat;
#endif
#endif
constexpr half operator""h(long double v) { return (half)v; }
constexpr half operator""h(unsigned long long v) { return (half)v; }

// ---------------------------------------------------------------- vectors
namespace metal {
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
}
using metal::vec;
#define MTL_VEC_TYPEDEFS(T)                                                       \
  typedef vec<T, 2> T##2;                                                         \
  typedef vec<T, 3> T##3;                                                         \
  typedef vec<T, 4> T##4;
#if !defined(MTL_CLCPP)
MTL_VEC_TYPEDEFS(bool)  // OpenCL has no bool vectors
#endif
MTL_VEC_TYPEDEFS(char)
MTL_VEC_TYPEDEFS(uchar)
MTL_VEC_TYPEDEFS(short)
MTL_VEC_TYPEDEFS(ushort)
MTL_VEC_TYPEDEFS(int)
MTL_VEC_TYPEDEFS(uint)
MTL_VEC_TYPEDEFS(long)
MTL_VEC_TYPEDEFS(ulong)
MTL_VEC_TYPEDEFS(half)
MTL_VEC_TYPEDEFS(float)
#if !defined(MTL_NO_BFLOAT)
MTL_VEC_TYPEDEFS(bfloat)
#endif

// packed vectors: 2/4 = ext vectors with scalar alignment; 3 = struct of 3.
#define MTL_PACKED(T)                                                             \
  typedef T packed_##T##2 __attribute__((ext_vector_type(2), aligned(sizeof(T))));\
  typedef T packed_##T##4 __attribute__((ext_vector_type(4), aligned(sizeof(T))));\
  struct packed_##T##3 {                                                          \
    T x, y, z;                                                                    \
    packed_##T##3() = default;                                                    \
    packed_##T##3(T##3 v) : x(v.x), y(v.y), z(v.z) {}                             \
    operator T##3() const { return T##3{x, y, z}; }                               \
    T operator[](int i) const { return i == 0 ? x : (i == 1 ? y : z); }           \
  };
MTL_PACKED(char)
MTL_PACKED(uchar)
MTL_PACKED(short)
MTL_PACKED(ushort)
MTL_PACKED(int)
MTL_PACKED(uint)
MTL_PACKED(half)
MTL_PACKED(float)
#if !defined(MTL_CLCPP) && !defined(MTL_NO_BFLOAT)
MTL_PACKED(bfloat)
#endif

namespace metal {
namespace detail {
template <class V> struct vinfo { typedef V elem; enum { n = 1, is_vec = 0 }; };
template <class T, int N> struct vinfo<vec<T, N>> { typedef T elem; enum { n = N, is_vec = 1 }; };
template <class A, class B> struct same { enum { v = 0 }; };
template <class A> struct same<A, A> { enum { v = 1 }; };
template <bool C, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <class T> struct is_ptr { enum { v = 0 }; };
template <class T> struct is_ptr<T *> { enum { v = 1 }; };
template <class T> struct rm_ref { typedef T type; };
template <class T> struct rm_ref<T &> { typedef T type; };

template <class T, int N, class A>
inline void put(T (&out)[N], int &k, A a) {
  if constexpr (vinfo<A>::is_vec) {
    for (int i = 0; i < vinfo<A>::n; ++i) out[k++] = (T)a[i];
  } else {
    out[k++] = (T)a;
  }
}
// Metal vector constructor semantics: T4(), T4(s) splat, T4(v4) conversion,
// T4(a, b, c, d) / T4(v2, s, s) / T4(v3, s) ... concatenation.
template <class T, int N, class... A> inline vec<T, N> make(A... a) {
  constexpr int total = (0 + ... + (int)vinfo<A>::n);
  if constexpr (sizeof...(A) == 0) {
    return (vec<T, N>)(T)0;
  } else if constexpr (sizeof...(A) == 1 && total == 1) {
    return (vec<T, N>)(T)(a, ...);
  } else {
    static_assert(total == N, "Metal vector constructor: wrong number of components");
    T tmp[N];
    int k = 0;
    (put(tmp, k, a), ...);
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = tmp[i];
    return r;
  }
}
} // namespace detail
} // namespace metal

// constructor syntax  float4(a, b, c, d)  -> function-like macros (a plain
// `float4 x;` is untouched because the macro only fires before '(').
#define char2(...) ::metal::detail::make<char, 2>(__VA_ARGS__)
#define char3(...) ::metal::detail::make<char, 3>(__VA_ARGS__)
#define char4(...) ::metal::detail::make<char, 4>(__VA_ARGS__)
#define uchar2(...) ::metal::detail::make<uchar, 2>(__VA_ARGS__)
#define uchar3(...) ::metal::detail::make<uchar, 3>(__VA_ARGS__)
#define uchar4(...) ::metal::detail::make<uchar, 4>(__VA_ARGS__)
#define short2(...) ::metal::detail::make<short, 2>(__VA_ARGS__)
#define short3(...) ::metal::detail::make<short, 3>(__VA_ARGS__)
#define short4(...) ::metal::detail::make<short, 4>(__VA_ARGS__)
#define ushort2(...) ::metal::detail::make<ushort, 2>(__VA_ARGS__)
#define ushort3(...) ::metal::detail::make<ushort, 3>(__VA_ARGS__)
#define ushort4(...) ::metal::detail::make<ushort, 4>(__VA_ARGS__)
#define int2(...) ::metal::detail::make<int, 2>(__VA_ARGS__)
#define int3(...) ::metal::detail::make<int, 3>(__VA_ARGS__)
#define int4(...) ::metal::detail::make<int, 4>(__VA_ARGS__)
#define uint2(...) ::metal::detail::make<uint, 2>(__VA_ARGS__)
#define uint3(...) ::metal::detail::make<uint, 3>(__VA_ARGS__)
#define uint4(...) ::metal::detail::make<uint, 4>(__VA_ARGS__)
#define long2(...) ::metal::detail::make<long, 2>(__VA_ARGS__)
#define ulong2(...) ::metal::detail::make<ulong, 2>(__VA_ARGS__)
#define half2(...) ::metal::detail::make<half, 2>(__VA_ARGS__)
#define half3(...) ::metal::detail::make<half, 3>(__VA_ARGS__)
#define half4(...) ::metal::detail::make<half, 4>(__VA_ARGS__)
#define float2(...) ::metal::detail::make<float, 2>(__VA_ARGS__)
#define float3(...) ::metal::detail::make<float, 3>(__VA_ARGS__)
#define float4(...) ::metal::detail::make<float, 4>(__VA_ARGS__)
#if !defined(MTL_NO_BFLOAT)
#define bfloat2(...) ::metal::detail::make<bfloat, 2>(__VA_ARGS__)
#define bfloat3(...) ::metal::detail::make<bfloat, 3>(__VA_ARGS__)
#define bfloat4(...) ::metal::detail::make<bfloat, 4>(__VA_ARGS__)
#endif
#define bool2(...) ::metal::detail::make<bool, 2>(__VA_ARGS__)
#define bool3(...) ::metal::detail::make<bool, 3>(__VA_ARGS__)
#define bool4(...) ::metal::detail::make<bool, 4>(__VA_ARGS__)

// ---------------------------------------------------------------- math
namespace metal {
using detail::vinfo;
#define MTL_EW1(name, expr)                                                       \
  template <class T> inline T name(T x) {                                         \
    if constexpr (vinfo<T>::is_vec) {                                             \
      T r;                                                                        \
      for (int i = 0; i < vinfo<T>::n; ++i) r[i] = name(x[i]);                    \
      return r;                                                                   \
    } else {                                                                      \
      float v = (float)x;                                                         \
      return (T)(expr);                                                           \
    }                                                                             \
  }
MTL_EW1(exp, __builtin_expf(v))
MTL_EW1(exp2, __builtin_exp2f(v))
MTL_EW1(log, __builtin_logf(v))
MTL_EW1(log2, __builtin_log2f(v))
MTL_EW1(sqrt, __builtin_sqrtf(v))
MTL_EW1(rsqrt, 1.0f / __builtin_sqrtf(v))
MTL_EW1(tanh, __builtin_tanhf(v))
MTL_EW1(sin, __builtin_sinf(v))
MTL_EW1(cos, __builtin_cosf(v))
MTL_EW1(erf, __builtin_erff(v))
MTL_EW1(floor, __builtin_floorf(v))
MTL_EW1(ceil, __builtin_ceilf(v))
MTL_EW1(round, __builtin_roundf(v))
MTL_EW1(rint, __builtin_rintf(v))
MTL_EW1(trunc, __builtin_truncf(v))
MTL_EW1(fabs, __builtin_fabsf(v))
MTL_EW1(fract, v - __builtin_floorf(v))
MTL_EW1(saturate, v < 0.f ? 0.f : (v > 1.f ? 1.f : v))
MTL_EW1(sign, v > 0.f ? 1.f : (v < 0.f ? -1.f : 0.f))
template <class T> inline T abs(T x) {
  if constexpr (vinfo<T>::is_vec) { T r; for (int i = 0; i < vinfo<T>::n; ++i) r[i] = abs(x[i]); return r; }
  else return x < (T)0 ? (T)-x : x;
}
template <class T> inline T pow(T x, T y) {
  if constexpr (vinfo<T>::is_vec) { T r; for (int i = 0; i < vinfo<T>::n; ++i) r[i] = pow(x[i], y[i]); return r; }
  else return (T)__builtin_powf((float)x, (float)y);
}
template <class T> inline T min(T a, T b) {
  if constexpr (vinfo<T>::is_vec) { T r; for (int i = 0; i < vinfo<T>::n; ++i) r[i] = min(a[i], b[i]); return r; }
  else return b < a ? b : a;
}
template <class T> inline T max(T a, T b) {
  if constexpr (vinfo<T>::is_vec) { T r; for (int i = 0; i < vinfo<T>::n; ++i) r[i] = max(a[i], b[i]); return r; }
  else return a < b ? b : a;
}
template <class T> inline T fmin(T a, T b) { return min(a, b); }
template <class T> inline T fmax(T a, T b) { return max(a, b); }
template <class T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T> inline T fma(T a, T b, T c) { return a * b + c; }
template <class T, class U> inline T mix(T x, T y, U a) { return x + (y - x) * a; }
template <class T> inline typename vinfo<T>::elem dot(T a, T b) {
  typename vinfo<T>::elem s = 0;
  for (int i = 0; i < vinfo<T>::n; ++i) s += a[i] * b[i];
  return s;
}
template <class T> inline typename vinfo<T>::elem length(T a) { return sqrt(dot(a, a)); }
template <class T> inline T normalize(T a) { return a * rsqrt(dot(a, a)); }
template <class M> inline bool all(M m) {
  if constexpr (vinfo<M>::is_vec) { for (int i = 0; i < vinfo<M>::n; ++i) if (!m[i]) return false; return true; }
  else return (bool)m;
}
template <class M> inline bool any(M m) {
  if constexpr (vinfo<M>::is_vec) { for (int i = 0; i < vinfo<M>::n; ++i) if (m[i]) return true; return false; }
  else return (bool)m;
}
template <class T, class M> inline T select(T a, T b, M c) {
  if constexpr (vinfo<T>::is_vec) { T r; for (int i = 0; i < vinfo<T>::n; ++i) r[i] = c[i] ? b[i] : a[i]; return r; }
  else return c ? b : a;
}
template <class T> inline bool isnan(T x) { return x != x; }
template <class T> inline bool isinf(T x) { return x == (T)__builtin_inff() || x == (T)-__builtin_inff(); }
namespace fast {
using metal::exp; using metal::exp2; using metal::log; using metal::log2; using metal::sqrt;
using metal::rsqrt; using metal::tanh; using metal::sin; using metal::cos; using metal::pow;
using metal::min; using metal::max; using metal::clamp; using metal::fabs; using metal::abs;
using metal::normalize; using metal::length; using metal::dot;
} // namespace fast
namespace precise {
using metal::exp; using metal::exp2; using metal::log; using metal::log2; using metal::sqrt;
using metal::rsqrt; using metal::tanh; using metal::sin; using metal::cos; using metal::pow;
using metal::min; using metal::max; using metal::clamp; using metal::fabs; using metal::abs;
} // namespace precise

// as_type<T>(x): bit reinterpretation, sizes must match.
template <class T, class U> inline T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type: source and destination must have the same size");
  return __builtin_bit_cast(T, x);
}

template <class T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float lowest() { return -3.40282347e+38f; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float epsilon() { return 1.1920929e-7f; }
};
template <> struct numeric_limits<half> {
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half infinity() { return (half)__builtin_inff(); }
};
template <> struct numeric_limits<uint> {
  static constexpr uint max() { return 0xffffffffu; }
  static constexpr uint min() { return 0u; }
};
template <> struct numeric_limits<int> {
  static constexpr int max() { return 0x7fffffff; }
  static constexpr int min() { return -0x7fffffff - 1; }
};
template <class A, class B> struct is_same { static constexpr bool value = detail::same<A, B>::v; };
template <class A, class B> constexpr bool is_same_v = detail::same<A, B>::v;
template <bool C, class T = void> using enable_if_t = typename detail::enable_if<C, T>::type;

// ---------------------------------------------------------------- sync
enum class mem_flags : uint {
  mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((uint)a | (uint)b); }
void threadgroup_barrier(mem_flags f);
void simdgroup_barrier(mem_flags f);

// ---------------------------------------------------------------- atomics
enum memory_order { memory_order_relaxed = 0, memory_order_acquire = 2, memory_order_release = 3,
                    memory_order_acq_rel = 4, memory_order_seq_cst = 5 };
#if defined(MTL_CLCPP)
// clang predeclares OpenCL's atomic_int/atomic_uint/atomic_float (= _Atomic(T)) in clc++2021.
// (metal::atomic<T> is not expressible here: no _Atomic in C++ for OpenCL)
#define MTL_ATOMIC_RMW(name, builtin)                                             \
  template <class A, class V> inline auto name(A *obj, V val, memory_order) {    \
    return builtin(obj, val, __ATOMIC_RELAXED);                                   \
  }
MTL_ATOMIC_RMW(atomic_fetch_add_explicit, __c11_atomic_fetch_add)
MTL_ATOMIC_RMW(atomic_fetch_sub_explicit, __c11_atomic_fetch_sub)
MTL_ATOMIC_RMW(atomic_fetch_and_explicit, __c11_atomic_fetch_and)
MTL_ATOMIC_RMW(atomic_fetch_or_explicit, __c11_atomic_fetch_or)
MTL_ATOMIC_RMW(atomic_fetch_xor_explicit, __c11_atomic_fetch_xor)
MTL_ATOMIC_RMW(atomic_fetch_max_explicit, __c11_atomic_fetch_max)
MTL_ATOMIC_RMW(atomic_fetch_min_explicit, __c11_atomic_fetch_min)
MTL_ATOMIC_RMW(atomic_exchange_explicit, __c11_atomic_exchange)
template <class A, class V> inline void atomic_store_explicit(A *obj, V val, memory_order) {
  __c11_atomic_store(obj, val, __ATOMIC_RELAXED);
}
template <class A> inline auto atomic_load_explicit(A *obj, memory_order) { return __c11_atomic_load(obj, __ATOMIC_RELAXED); }
template <class A, class E, class V>
inline bool atomic_compare_exchange_weak_explicit(A *obj, E *expected, V desired, memory_order, memory_order) {
  return __c11_atomic_compare_exchange_weak(obj, expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}
#else
template <class T> struct _atomic { T __v; };
template <class T> using atomic = _atomic<T>;
typedef _atomic<int> atomic_int;
typedef _atomic<uint> atomic_uint;
typedef _atomic<float> atomic_float;
typedef _atomic<bool> atomic_bool;
#define MTL_ATOMIC_RMW(name, builtin)                                             \
  template <class A, class V> inline auto name(A *obj, V val, memory_order) {    \
    typedef decltype(obj->__v + 0) T;                                             \
    return builtin((T *)&obj->__v, (T)val, __ATOMIC_SEQ_CST);                     \
  }
MTL_ATOMIC_RMW(atomic_fetch_add_explicit, __atomic_fetch_add)
MTL_ATOMIC_RMW(atomic_fetch_sub_explicit, __atomic_fetch_sub)
MTL_ATOMIC_RMW(atomic_fetch_and_explicit, __atomic_fetch_and)
MTL_ATOMIC_RMW(atomic_fetch_or_explicit, __atomic_fetch_or)
MTL_ATOMIC_RMW(atomic_fetch_xor_explicit, __atomic_fetch_xor)
MTL_ATOMIC_RMW(atomic_fetch_max_explicit, __atomic_fetch_max)
MTL_ATOMIC_RMW(atomic_fetch_min_explicit, __atomic_fetch_min)
MTL_ATOMIC_RMW(atomic_exchange_explicit, __atomic_exchange_n)
template <class A, class V> inline void atomic_store_explicit(A *obj, V val, memory_order) {
  typedef decltype(obj->__v + 0) T;
  __atomic_store_n((T *)&obj->__v, (T)val, __ATOMIC_SEQ_CST);
}
template <class A> inline auto atomic_load_explicit(A *obj, memory_order) {
  typedef decltype(obj->__v + 0) T;
  return __atomic_load_n((T *)&obj->__v, __ATOMIC_SEQ_CST);
}
template <class A, class E, class V>
inline bool atomic_compare_exchange_weak_explicit(A *obj, E *expected, V desired, memory_order, memory_order) {
  typedef decltype(obj->__v + 0) T;
  return __atomic_compare_exchange_n((T *)&obj->__v, (T *)expected, (T)desired, true, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST);
}
#endif
} // namespace metal

// ---------------------------------------------------------------- runtime interface
namespace mtl_rt {
struct ThreadIds {
  uint3 tpig, tpitg, tgpig, tptg, tgpg, grid;
  uint tid, sgid, lane, nsg;
};
const ThreadIds &ids();
void *buffer_ptr(int i);
void *tg_buffer_ptr(int i);
// publish n bytes from this lane, wait for the active lanes of the simdgroup at the
// same call site, return their values (32 slots) and the active-lane mask.
const unsigned char *simd_exchange(const void *v, unsigned n, unsigned site, unsigned *mask);
void tg_barrier();
// The running simdgroup's 64-float scratch for the collective just released; *stale: it does
// not hold this release's result yet (the caller computes it, and the lanes after it read it).
float *sg_cache(bool *stale);
enum { SLOT = 256 };
} // namespace mtl_rt

// ---------------------------------------------------------------- simd collectives
namespace metal {
#define MTL_SITE unsigned _site = __builtin_LINE() * 4096u + __builtin_COLUMN()
template <class T> inline const T *_lanes(T x, unsigned *mask, unsigned site) {
  static_assert(sizeof(T) <= mtl_rt::SLOT, "simd value too large");
  return (const T *)mtl_rt::simd_exchange(&x, sizeof(T), site, mask);
}
inline const void *_slot(const void *base, uint lane) {
  return (const unsigned char *)base + lane * mtl_rt::SLOT;
}
#define MTL_LANE(T, base, l) (*(const T *)_slot(base, l))
#define MTL_REDUCE(name, init, op)                                                \
  template <class T> inline T name(T x, MTL_SITE) {                               \
    unsigned m;                                                                   \
    const T *b = _lanes(x, &m, _site);                                            \
    bool first = true;                                                            \
    T acc = x;                                                                    \
    for (uint l = 0; l < 32; ++l)                                                 \
      if (m & (1u << l)) {                                                        \
        T v = MTL_LANE(T, b, l);                                                  \
        if (first) { acc = v; first = false; } else { acc = op; }                 \
      }                                                                           \
    return acc;                                                                   \
  }
MTL_REDUCE(simd_sum, 0, acc + v)
MTL_REDUCE(simd_product, 1, acc * v)
MTL_REDUCE(simd_max, 0, max(acc, v))
MTL_REDUCE(simd_min, 0, min(acc, v))
MTL_REDUCE(simd_and, 0, acc & v)
MTL_REDUCE(simd_or, 0, acc | v)
MTL_REDUCE(simd_xor, 0, acc ^ v)
template <class T> inline T simd_shuffle(T x, ushort src, MTL_SITE) {
  unsigned m;
  const T *b = _lanes(x, &m, _site);
  return MTL_LANE(T, b, src & 31u);
}
template <class T> inline T simd_broadcast(T x, ushort src, MTL_SITE) {
  unsigned m;
  const T *b = _lanes(x, &m, _site);
  return MTL_LANE(T, b, src & 31u);
}
template <class T> inline T simd_shuffle_xor(T x, ushort mask_, MTL_SITE) {
  unsigned m;
  const T *b = _lanes(x, &m, _site);
  return MTL_LANE(T, b, (mtl_rt::ids().lane ^ mask_) & 31u);
}
template <class T> inline T simd_shuffle_down(T x, ushort d, MTL_SITE) {
  unsigned m;
  const T *b = _lanes(x, &m, _site);
  uint l = mtl_rt::ids().lane + d;
  return l < 32 ? MTL_LANE(T, b, l) : x;  // out of range: own value (as on Apple GPUs)
}
template <class T> inline T simd_shuffle_up(T x, ushort d, MTL_SITE) {
  unsigned m;
  const T *b = _lanes(x, &m, _site);
  uint me = mtl_rt::ids().lane;
  return me >= d ? MTL_LANE(T, b, me - d) : x;
}
template <class T> inline T simd_broadcast_first(T x, MTL_SITE) {
  unsigned m;
  const T *b = _lanes(x, &m, _site);
  return MTL_LANE(T, b, (uint)__builtin_ctz(m));
}
template <class T> inline T simd_prefix_exclusive_sum(T x, MTL_SITE) {
  unsigned m;
  const T *b = _lanes(x, &m, _site);
  T acc = (T)0;
  for (uint l = 0; l < mtl_rt::ids().lane; ++l) if (m & (1u << l)) acc += MTL_LANE(T, b, l);
  return acc;
}
template <class T> inline T simd_prefix_inclusive_sum(T x, MTL_SITE) { return simd_prefix_exclusive_sum(x, _site) + x; }
inline bool simd_all(bool x, MTL_SITE) {
  unsigned m; const bool *b = _lanes(x, &m, _site);
  for (uint l = 0; l < 32; ++l) if ((m & (1u << l)) && !MTL_LANE(bool, b, l)) return false;
  return true;
}
inline bool simd_any(bool x, MTL_SITE) {
  unsigned m; const bool *b = _lanes(x, &m, _site);
  for (uint l = 0; l < 32; ++l) if ((m & (1u << l)) && MTL_LANE(bool, b, l)) return true;
  return false;
}
inline bool simd_is_first(MTL_SITE) {
  unsigned m; _lanes(0, &m, _site);
  return mtl_rt::ids().lane == (uint)__builtin_ctz(m);
}

// ---------------------------------------------------------------- simdgroup_matrix
// Distributed exactly like Apple GPUs (as documented by reverse engineering and
// used by MLX): lane l holds row (qid&4)+((l/2)%4), columns (qid&2)*2+(l%2)*2 +0/+1,
// qid = l/4.  Loads/stores touch only the lane's own two elements; multiply-
// accumulate gathers the three operands across the simdgroup.
inline ushort2 _sgm_coord(uint l) {
  uint qid = l / 4;
  return ushort2((ushort)((qid & 2) * 2 + (l % 2) * 2), (ushort)((qid & 4) + ((l / 2) % 4)));
}
template <class T, int R, int C> struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "only 8x8 simdgroup matrices are supported");
  vec<T, 2> e;
  simdgroup_matrix() = default;
  vec<T, 2> &thread_elements() { return e; }
  const vec<T, 2> &thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
#if !defined(MTL_NO_BFLOAT)
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
#endif
template <class T, int R, int C> inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> m;
  m.e = (vec<T, 2>)v;
  return m;
}
template <class T, class P, int R, int C>
inline void simdgroup_load(thread simdgroup_matrix<T, R, C> &m, P *src, ulong elements_per_row = C,
                           ulong2 origin = ulong2(0, 0), bool transpose = false) {
  ushort2 c = _sgm_coord(mtl_rt::ids().lane);
  for (int j = 0; j < 2; ++j) {
    ulong row = c.y, col = c.x + j;
    if (transpose) { ulong t = row; row = col; col = t; }
    m.e[j] = (T)src[(origin.y + row) * elements_per_row + origin.x + col];
  }
}
template <class T, class P, int R, int C>
inline void simdgroup_store(simdgroup_matrix<T, R, C> m, P *dst, ulong elements_per_row = C,
                            ulong2 origin = ulong2(0, 0), bool transpose = false) {
  ushort2 c = _sgm_coord(mtl_rt::ids().lane);
  for (int j = 0; j < 2; ++j) {
    ulong row = c.y, col = c.x + j;
    if (transpose) { ulong t = row; row = col; col = t; }
    dst[(origin.y + row) * elements_per_row + origin.x + col] = m.e[j];
  }
}
template <class T, class U, class V, class W>
inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, 8, 8> &d, simdgroup_matrix<U, 8, 8> a,
                                          simdgroup_matrix<V, 8, 8> b, simdgroup_matrix<W, 8, 8> c,
                                          MTL_SITE) {
  struct Pack { float a0, a1, b0, b1, c0, c1; };
  Pack p = {(float)a.e[0], (float)a.e[1], (float)b.e[0], (float)b.e[1], (float)c.e[0], (float)c.e[1]};
  unsigned m;
  const Pack *all = _lanes(p, &m, _site);
  // The product depends on the gathered operands only: the first lane after the release computes
  // all 64 elements (each summed in the same order as one lane would), the others read theirs.
  bool stale;
  float *D = mtl_rt::sg_cache(&stale);
  if (stale) {
    float A[8][8], B[8][8], Cm[8][8];
    for (uint l = 0; l < 32; ++l) {
      ushort2 cc = _sgm_coord(l);
      const Pack &q = MTL_LANE(Pack, all, l);
      A[cc.y][cc.x] = q.a0; A[cc.y][cc.x + 1] = q.a1;
      B[cc.y][cc.x] = q.b0; B[cc.y][cc.x + 1] = q.b1;
      Cm[cc.y][cc.x] = q.c0; Cm[cc.y][cc.x + 1] = q.c1;
    }
    for (int r = 0; r < 8; ++r)
      for (int c = 0; c < 8; ++c) {
        float s = Cm[r][c];
        for (int k = 0; k < 8; ++k) s += A[r][k] * B[k][c];
        D[r * 8 + c] = s;
      }
  }
  ushort2 me = _sgm_coord(mtl_rt::ids().lane);
  for (int j = 0; j < 2; ++j) d.e[j] = (T)D[me.y * 8 + me.x + j];
}
template <class T, class U, class V>
inline void simdgroup_multiply(thread simdgroup_matrix<T, 8, 8> &d, simdgroup_matrix<U, 8, 8> a,
                               simdgroup_matrix<V, 8, 8> b, MTL_SITE) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, 8, 8>((T)0), _site);
}
} // namespace metal

// ---------------------------------------------------------------- kernel argument binders
namespace mtl_rt {
using metal::detail::same;
template <class T> constexpr bool is_pos3 =
    same<T, uint>::v || same<T, ushort>::v || same<T, uint2>::v || same<T, ushort2>::v ||
    same<T, uint3>::v || same<T, ushort3>::v;
template <class T> constexpr bool is_pos1 = same<T, uint>::v || same<T, ushort>::v;
struct pos3_binder {
  uint3 v;
  template <class T> operator T() const {
    static_assert(is_pos3<T>, "this Metal attribute needs a uint/ushort (vector) parameter");
    if constexpr (metal::detail::vinfo<T>::n == 1) return (T)v.x;
    else if constexpr (metal::detail::vinfo<T>::n == 2) return __builtin_convertvector(v.xy, T);
    else return __builtin_convertvector(v, T);
  }
};
struct pos1_binder {
  uint v;
  template <class T> operator T() const {
    static_assert(is_pos1<T>, "this Metal attribute needs a scalar uint/ushort parameter");
    return (T)v;
  }
};
struct buffer_binder {
  int i;
  template <class T> static constexpr bool ok_space =
#if defined(MTL_EXEC) || defined(MTL_CLCPP)
      true;
#else
      __is_convertible_to(T *, const volatile MTL_AS_DEVICE void *) ||
      __is_convertible_to(T *, const volatile MTL_AS_CONSTANT void *);
#endif
  template <class T> operator T *() const {
    static_assert(ok_space<T>, "[[buffer(n)]] parameter must point to device or constant memory");
    return (T *)buffer_ptr(i);
  }
  template <class T, class = typename metal::detail::enable_if<!metal::detail::is_ptr<T>::v>::type>
  operator T &() const {
    static_assert(ok_space<T>, "[[buffer(n)]] reference must refer to device or constant memory");
    return *(T *)buffer_ptr(i);
  }
};
struct tg_binder {
  int i;
  template <class T> operator T *() const {
#if !defined(MTL_EXEC) && !defined(MTL_CLCPP)
    static_assert(__is_convertible_to(T *, const volatile MTL_AS_THREADGROUP void *),
                  "[[threadgroup(n)]] parameter must point to threadgroup memory");
#endif
    return (T *)tg_buffer_ptr(i);
  }
};
} // namespace mtl_rt

#define MTL_CAT2(a, b) a##b
#define MTL_CAT(a, b) MTL_CAT2(a, b)
#if defined(MTL_CLCPP)
#define MTL_BIND(name, expr) clang::annotate(#name)
#else
#define MTL_BIND(name, expr) ]] = expr, auto... MTL_CAT(_mtl_unused_, __COUNTER__) [[
#endif
#define buffer(i) MTL_BIND(buffer, (::mtl_rt::buffer_binder{i}))
// [[threadgroup(i)]] cannot share a macro name with the `threadgroup` qualifier;
// mtl_lower.py renames it to [[mtl_threadgroup_arg(i)]].
#define mtl_threadgroup_arg(i) MTL_BIND(threadgroup, (::mtl_rt::tg_binder{i}))
#define thread_position_in_grid MTL_BIND(tpig, (::mtl_rt::pos3_binder{::mtl_rt::ids().tpig}))
#define thread_position_in_threadgroup MTL_BIND(tpitg, (::mtl_rt::pos3_binder{::mtl_rt::ids().tpitg}))
#define threadgroup_position_in_grid MTL_BIND(tgpig, (::mtl_rt::pos3_binder{::mtl_rt::ids().tgpig}))
#define threads_per_threadgroup MTL_BIND(tptg, (::mtl_rt::pos3_binder{::mtl_rt::ids().tptg}))
#define threadgroups_per_grid MTL_BIND(tgpg, (::mtl_rt::pos3_binder{::mtl_rt::ids().tgpg}))
#define threads_per_grid MTL_BIND(grid, (::mtl_rt::pos3_binder{::mtl_rt::ids().grid}))
#define thread_index_in_threadgroup MTL_BIND(tid, (::mtl_rt::pos1_binder{::mtl_rt::ids().tid}))
#define thread_index_in_simdgroup MTL_BIND(lane, (::mtl_rt::pos1_binder{::mtl_rt::ids().lane}))
#define simdgroup_index_in_threadgroup MTL_BIND(sgid, (::mtl_rt::pos1_binder{::mtl_rt::ids().sgid}))
#define simdgroups_per_threadgroup MTL_BIND(nsg, (::mtl_rt::pos1_binder{::mtl_rt::ids().nsg}))
#define threads_per_simdgroup MTL_BIND(tpsg, (::mtl_rt::pos1_binder{32u}))
#define thread_execution_width MTL_BIND(tew, (::mtl_rt::pos1_binder{32u}))
// kernel-level attributes: accepted, checked for syntax only
#define max_total_threads_per_threadgroup(n) clang::annotate("max_total_threads_per_threadgroup", n)
#define host_name(s) clang::annotate("host_name", s)

// ---------------------------------------------------------------- EXEC runtime
// Each threadgroup runs its threads as fibers on one OS thread; a fiber runs until it reaches a
// barrier or a simd collective (or returns), then the next runnable fiber of the pass runs (in
// thread order, or reversed with MTL_SCHED=reverse); when none is left, the scheduler releases
// the simdgroups whose lanes all wait at one collective (else a threadgroup barrier) and starts
// the next pass. The order is that of a loop over the threads per pass, but a fiber switches
// straight to the next one (not through the scheduler), and on x86-64 with a few instructions
// (callee-saved registers and the stack pointer) instead of swapcontext, whose signal-mask
// system call cost more than the emulated work. The threadgroups of a dispatch are shared out
// over MTL_THREADS OS threads (default: the online CPUs), each with its own fibers and
// threadgroup memory: threadgroups of one dispatch are independent on a GPU too (they may run
// in any order, or at once), and a kernel that relies on their order is wrong there.
#if defined(MTL_EXEC)
#include <pthread.h>
namespace mtl_rt {
enum State { READY, WAIT_TG, WAIT_SIMD, DONE };
#if defined(__x86_64__) && defined(__ELF__)
// A suspended fiber: its stack pointer; the stack holds the callee-saved registers and the return
// address (mtl_rt_switch). The MXCSR and x87 control words are not switched: every fiber runs
// kernel code, which never changes them.
struct Cont { void *sp; };
asm(".text\n"
    ".p2align 4\n"
    ".type mtl_rt_switch,@function\n"
    "mtl_rt_switch:\n"  // (void **save_sp [rdi], void *load_sp [rsi])
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size mtl_rt_switch, .-mtl_rt_switch\n");
extern "C" __attribute__((visibility("hidden"))) void mtl_rt_switch(void **save_sp, void *load_sp);
inline void cont_switch(Cont *save, Cont *load) { mtl_rt_switch(&save->sp, load->sp); }
// A fresh fiber: `entry` runs on `stack` (it never returns).
inline void cont_make(Cont *k, char *stack, size_t size, void (*entry)()) {
  unsigned long top = ((unsigned long)stack + size) & ~15ul;
  void **sp = (void **)top;
  *--sp = nullptr;          // entry's return address (it never returns): rsp = 8 mod 16 at entry
  *--sp = (void *)entry;    // popped by mtl_rt_switch's ret
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
  k->sp = sp;
}
#else
struct Cont { ucontext_t uc; };
inline void cont_switch(Cont *save, Cont *load) { swapcontext(&save->uc, &load->uc); }
inline void cont_make(Cont *k, char *stack, size_t size, void (*entry)()) {
  getcontext(&k->uc);
  k->uc.uc_stack.ss_sp = stack;
  k->uc.uc_stack.ss_size = size;
  k->uc.uc_link = nullptr;  // entry never returns
  makecontext(&k->uc, entry, 0);
}
#endif
struct Fiber {
  Cont k;
  State st;
  bool outside;  // beyond the grid of a non-uniform dispatch: never existed
  unsigned site;
  unsigned size;  // bytes of `slot` the waiting collective exchanges
  ThreadIds ids;
  alignas(16) unsigned char slot[SLOT];
};
struct Ctx {
  void (*fn)();
  Fiber *f = nullptr;
  unsigned n = 0;    // threads of the threadgroup
  unsigned pos = 0;  // the running fiber's place in this pass's order
  char *stacks = nullptr;
  size_t stack_sz = 256 * 1024;
  int cur = -1;
  Cont sched;
  void **bufs = nullptr;
  int nbufs = 0;
  void **tgbufs = nullptr;
  int ntg = 0;
  alignas(16) unsigned char snap[32][32 * SLOT];
  unsigned snap_mask[32];
  // Releases of each simdgroup so far, and the release whose 8x8 matrix product sg_cache holds
  // (the first lane after a release computes it for all).
  unsigned snap_gen[32];
  unsigned cache_gen[32];
  float cache[32][64];
  const char *err = nullptr;
  bool reverse = false;
};
inline thread_local Ctx *g_ctx = nullptr;
inline const ThreadIds &ids() { return g_ctx->f[g_ctx->cur].ids; }
inline void *buffer_ptr(int i) {
  if (i < 0 || i >= g_ctx->nbufs || !g_ctx->bufs[i]) { fprintf(stderr, "mtl: buffer(%d) not bound\n", i); abort(); }
  return g_ctx->bufs[i];
}
inline void *tg_buffer_ptr(int i) {
  if (i < 0 || i >= g_ctx->ntg) { fprintf(stderr, "mtl: threadgroup(%d) not bound\n", i); abort(); }
  return g_ctx->tgbufs[i];
}
inline float *sg_cache(bool *stale) {
  Ctx &c = *g_ctx;
  unsigned sg = c.f[c.cur].ids.sgid;
  *stale = c.cache_gen[sg] != c.snap_gen[sg];
  c.cache_gen[sg] = c.snap_gen[sg];
  return c.cache[sg];
}
// Suspend the running fiber (its state already set): run the next READY fiber of this pass, or
// go back to the scheduler when there is none.
inline void _yield() {
  Ctx &c = *g_ctx;
  Cont *me = &c.f[c.cur].k;
  for (unsigned p = c.pos + 1; p < c.n; ++p) {
    unsigned t = c.reverse ? c.n - 1 - p : p;  // MTL_SCHED=reverse exposes missing barriers
    if (c.f[t].st == READY) {
      c.pos = p;
      c.cur = (int)t;
      cont_switch(me, &c.f[t].k);
      return;
    }
  }
  cont_switch(me, &c.sched);
}
inline void tg_barrier() {
  g_ctx->f[g_ctx->cur].st = WAIT_TG;
  _yield();
}
inline const unsigned char *simd_exchange(const void *v, unsigned n, unsigned site, unsigned *mask) {
  Fiber &me = g_ctx->f[g_ctx->cur];
  memcpy(me.slot, v, n);
  me.size = n;
  me.st = WAIT_SIMD;
  me.site = site;
  _yield();
  unsigned sg = me.ids.sgid;
  *mask = g_ctx->snap_mask[sg];
  return g_ctx->snap[sg];
}
inline void _entry() {
  g_ctx->fn();
  g_ctx->f[g_ctx->cur].st = DONE;
  _yield();  // never resumed
  abort();
}
// Runs one threadgroup; returns 0 or -1 on deadlock/divergence.
inline int _run_group(const uint3 tgpig, const uint3 tptg, const uint3 tgpg, const uint3 grid_threads) {
  Ctx &c = *g_ctx;
  unsigned n = tptg.x * tptg.y * tptg.z;
  unsigned nsg = (n + 31) / 32;
  c.n = n;
  for (unsigned t = 0; t < n; ++t) {
    Fiber &f = c.f[t];
    f.st = READY;
    f.outside = false;
    f.ids.tpitg = uint3(t % tptg.x, (t / tptg.x) % tptg.y, t / (tptg.x * tptg.y));
    f.ids.tgpig = tgpig;
    f.ids.tptg = tptg;
    f.ids.tgpg = tgpg;
    f.ids.grid = grid_threads;
    f.ids.tpig = tgpig * tptg + f.ids.tpitg;
    f.ids.tid = t;
    f.ids.sgid = t / 32;
    f.ids.lane = t % 32;
    f.ids.nsg = nsg;
    // non-uniform threadgroups (dispatchThreads): threads outside the grid do not exist
    if (f.ids.tpig.x >= grid_threads.x || f.ids.tpig.y >= grid_threads.y || f.ids.tpig.z >= grid_threads.z) {
      f.st = DONE;
      f.outside = true;
      continue;
    }
    // The stacks' tops are staggered (by 1104 bytes a thread, modulo 32 KiB): stacks exactly
    // stack_sz apart would put every fiber's live frames in the same cache sets.
    cont_make(&f.k, c.stacks + (size_t)t * c.stack_sz, c.stack_sz - t * 1104 % 32768, _entry);
  }
  for (;;) {
    // A pass: the first READY fiber in order runs; each one hands over to the next (_yield).
    bool ran = false;
    for (unsigned p = 0; p < n; ++p) {
      unsigned t = c.reverse ? n - 1 - p : p;
      if (c.f[t].st == READY) {
        c.pos = p;
        c.cur = (int)t;
        cont_switch(&c.sched, &c.f[t].k);
        ran = true;
        break;
      }
    }
    if (ran) continue;
    // nobody runnable: release a simdgroup collective or a threadgroup barrier
    bool any_alive = false, released = false, all_tg = true;
    for (unsigned sg = 0; sg < nsg; ++sg) {
      unsigned lo = sg * 32, hi = lo + 32 < n ? lo + 32 : n;
      int first = -1;
      for (unsigned t = lo; t < hi; ++t) {
        if (c.f[t].st != DONE) any_alive = true;
        if (c.f[t].st == WAIT_SIMD && first < 0) first = (int)t;
        if (c.f[t].st != DONE && c.f[t].st != WAIT_TG) all_tg = false;
      }
      if (first < 0) continue;
      // active lanes = lanes of this simdgroup waiting at the same call site
      unsigned mask = 0, site = c.f[first].site;
      for (unsigned t = lo; t < hi; ++t)
        if (c.f[t].st == WAIT_SIMD && c.f[t].site == site) {
          mask |= 1u << (t - lo);
          memcpy(c.snap[sg] + (t - lo) * SLOT, c.f[t].slot, c.f[t].size);
        }
      c.snap_mask[sg] = mask;
      ++c.snap_gen[sg];
      for (unsigned t = lo; t < hi; ++t)
        if (mask & (1u << (t - lo))) c.f[t].st = READY;
      released = true;
    }
    if (!any_alive) return 0;
    if (released) continue;
    if (all_tg) {
      for (unsigned t = 0; t < n; ++t)
        if (c.f[t].st == DONE && !c.f[t].outside) {
          c.err = "threadgroup_barrier not reached by every thread of the threadgroup (some returned early)";
          return -1;
        }
      for (unsigned t = 0; t < n; ++t)
        if (c.f[t].st == WAIT_TG) c.f[t].st = READY;
      continue;
    }
    c.err = "deadlock";
    return -1;
  }
}
} // namespace mtl_rt

// dispatchThreadgroups(tg_count, tg_size)  if grid_threads == 0 (uniform);
// otherwise dispatchThreads(grid_threads, tg_size) with non-uniform edge groups.
namespace mtl_rt {
// Fiber order of the dispatches this OS thread makes next: -1 MTL_SCHED decides, 0 forward,
// 1 reverse (mtl_set_schedule).
inline thread_local int g_schedule = -1;
// Guarded copies: each buffer is copied so that its last byte sits right before a
// PROT_NONE page; any read/write past the end faults and is reported.
struct Guarded { char *base; size_t total; char *data; void *user; size_t n; };
inline thread_local Guarded *g_guards = nullptr;  // of the dispatch this OS thread runs a part of
inline thread_local int g_nguards = 0;
inline void _segv(int, siginfo_t *si, void *) {
  char *a = (char *)si->si_addr;
  for (int i = 0; i < g_nguards; ++i) {
    Guarded &G = g_guards[i];
    if (a >= G.base && a < G.base + G.total) {
      fprintf(stderr, "mtl: out-of-bounds access to buffer %d: byte offset %ld (buffer has %zu bytes), thread_position_in_grid=(%u,%u,%u)\n",
              i, (long)(a - G.data), G.n, g_ctx ? g_ctx->f[g_ctx->cur].ids.tpig.x : 0u,
              g_ctx ? g_ctx->f[g_ctx->cur].ids.tpig.y : 0u, g_ctx ? g_ctx->f[g_ctx->cur].ids.tpig.z : 0u);
      _exit(86);
    }
  }
  fprintf(stderr, "mtl: segmentation fault at %p\n", (void *)a);
  _exit(87);
}
inline Guarded guard_copy(void *user, size_t n) {
  size_t pg = 4096, body = (n + pg - 1) / pg * pg;
  Guarded G;
  G.total = body + pg;
  G.base = (char *)mmap(nullptr, G.total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  mprotect(G.base + body, pg, PROT_NONE);
  G.data = G.base + body - n;
  G.user = user;
  G.n = n;
  if (user) memcpy(G.data, user, n);
  return G;
}
// One dispatch shared by its OS threads: each takes the next threadgroup (x fastest) until none
// is left or one fails.
struct Job {
  void (*fn)();
  uint3 tptg, tgpg, grid;
  void **bufs;
  int nbufs;
  const unsigned long *tg_bytes;
  int ntg;
  bool reverse;
  Guarded *guards;  // with bounds checking (else null), for the fault handler's message
  int nguards;
  unsigned long groups;
  unsigned long next;  // atomic: the next threadgroup to take
  int rc;              // atomic: the first failure
  const char *err;     // written by the thread that set rc
  uint3 err_group;
};
inline void _run_groups(Job &j) {
  unsigned n = j.tptg.x * j.tptg.y * j.tptg.z;
  Ctx *c = new Ctx();
  g_ctx = c;
  g_guards = j.guards;
  g_nguards = j.nguards;
  c->fn = j.fn;
  c->reverse = j.reverse;
  c->f = new Fiber[n];
  c->stacks = (char *)mmap(nullptr, c->stack_sz * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  c->bufs = j.bufs;
  c->nbufs = j.nbufs;
  c->ntg = j.ntg;
  c->tgbufs = (void **)calloc(j.ntg > 0 ? j.ntg : 1, sizeof(void *));
  for (int i = 0; i < j.ntg; ++i) c->tgbufs[i] = calloc(1, j.tg_bytes[i] ? j.tg_bytes[i] : 1);
  for (;;) {
    unsigned long g = __atomic_fetch_add(&j.next, 1ul, __ATOMIC_RELAXED);
    if (g >= j.groups || __atomic_load_n(&j.rc, __ATOMIC_RELAXED)) break;
    uint3 tg = uint3((uint)(g % j.tgpg.x), (uint)(g / j.tgpg.x % j.tgpg.y), (uint)(g / j.tgpg.x / j.tgpg.y));
    for (int i = 0; i < j.ntg; ++i) memset(c->tgbufs[i], 0xff, j.tg_bytes[i]);  // poison: NaN / 0xffff...
    if (_run_group(tg, j.tptg, j.tgpg, j.grid)) {
      int none = 0;
      if (__atomic_compare_exchange_n(&j.rc, &none, -1, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        j.err = c->err;
        j.err_group = tg;
      }
      break;
    }
  }
  for (int i = 0; i < j.ntg; ++i) free(c->tgbufs[i]);
  free(c->tgbufs);
  munmap(c->stacks, c->stack_sz * n);
  delete[] c->f;
  delete c;
  g_ctx = nullptr;
  g_guards = nullptr;
  g_nguards = 0;
}
inline void *_worker(void *job) {
  _run_groups(*(Job *)job);
  return nullptr;
}
// OS threads per dispatch: MTL_THREADS, else the CPUs online.
inline unsigned _threads() {
  const char *e = getenv("MTL_THREADS");
  long v = e && *e ? atol(e) : sysconf(_SC_NPROCESSORS_ONLN);
  return v < 1 ? 1u : v > 64 ? 64u : (unsigned)v;
}
} // namespace mtl_rt

// buf_bytes == nullptr: buffers are used in place (no bounds checking).
extern "C" __attribute__((visibility("default"))) int
mtl_dispatch(void (*fn)(), const unsigned *tg_count, const unsigned *tg_size, const unsigned *grid_threads,
             void **bufs_in, const unsigned long *buf_bytes, int nbufs, const unsigned long *tg_bytes, int ntg) {
  using namespace mtl_rt;
  void **bufs = bufs_in;
  Guarded *guards = nullptr;
  if (buf_bytes) {
    guards = new Guarded[nbufs > 0 ? nbufs : 1];
    bufs = new void *[nbufs > 0 ? nbufs : 1];
    for (int i = 0; i < nbufs; ++i) {
      guards[i] = guard_copy(bufs_in[i], buf_bytes[i]);
      bufs[i] = bufs_in[i] ? guards[i].data : nullptr;
    }
    static char altstack[65536];
    stack_t ss; ss.ss_sp = altstack; ss.ss_size = sizeof altstack; ss.ss_flags = 0;
    sigaltstack(&ss, nullptr);
    struct sigaction sa; memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = _segv; sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
  }
  Job j;
  j.fn = fn;
  j.reverse = g_schedule >= 0 ? g_schedule == 1 : getenv("MTL_SCHED") && !strcmp(getenv("MTL_SCHED"), "reverse");
  j.tptg = uint3(tg_size[0], tg_size[1], tg_size[2]);
  if (grid_threads && grid_threads[0]) {
    j.grid = uint3(grid_threads[0], grid_threads[1], grid_threads[2]);
    j.tgpg = (j.grid + j.tptg - 1u) / j.tptg;
  } else {
    j.tgpg = uint3(tg_count[0], tg_count[1], tg_count[2]);
    j.grid = j.tgpg * j.tptg;
  }
  unsigned n = j.tptg.x * j.tptg.y * j.tptg.z;
  int rc = 0;
  if (n == 0 || n > 1024) {
    fprintf(stderr, "mtl: bad threadgroup size %u\n", n);
    rc = -2;
  } else {
    j.bufs = bufs;
    j.nbufs = nbufs;
    j.guards = guards;
    j.nguards = guards ? nbufs : 0;
    j.tg_bytes = tg_bytes;
    j.ntg = ntg;
    j.groups = (unsigned long)j.tgpg.x * j.tgpg.y * j.tgpg.z;
    j.next = 0;
    j.rc = 0;
    j.err = nullptr;
    j.err_group = uint3(0, 0, 0);
    unsigned want = _threads();
    unsigned extra = j.groups < want ? (unsigned)j.groups - (j.groups > 0) : want - 1;
    pthread_t th[64];
    unsigned started = 0;
    for (; started < extra; ++started)
      if (pthread_create(&th[started], nullptr, _worker, &j)) break;  // fewer threads: still correct
    _run_groups(j);
    for (unsigned i = 0; i < started; ++i) pthread_join(th[i], nullptr);
    rc = j.rc;
    if (rc) fprintf(stderr, "mtl: %s (threadgroup %u,%u,%u)\n", j.err, j.err_group.x, j.err_group.y, j.err_group.z);
  }
  if (guards) {
    for (int i = 0; i < nbufs; ++i) {
      // Copied back only where the kernel changed it: a read-only binding (weights wrapped in
      // place from a read-only mapping) is never written.
      if (guards[i].user && memcmp(guards[i].user, guards[i].data, guards[i].n) != 0)
        memcpy(guards[i].user, guards[i].data, guards[i].n);
      munmap(guards[i].base, guards[i].total);
    }
    delete[] guards;
    delete[] bufs;
  }
  return rc;
}
// The fiber order of this OS thread's next mtl_dispatch calls: -1 (default) as MTL_SCHED says,
// 0 forward, 1 reverse. Lets a test run one dispatch reversed without touching the environment.
extern "C" __attribute__((visibility("default"))) void mtl_set_schedule(int mode) { mtl_rt::g_schedule = mode; }
#define MTL_EXPORT(name)                                                          \
  static void _mtl_call_##name() { name(); }                                      \
  extern "C" __attribute__((visibility("default"))) void (*mtl_kernel_##name())() { return &_mtl_call_##name; }
#endif // MTL_EXEC

// MTL_EXPORT_AS(name, fn<args>): a template kernel instance under its host name (see
// shaders/metal/common.h INSTANTIATE). EXEC exports it; the check modes instantiate its body.
#if defined(MTL_EXEC)
#define MTL_EXPORT_AS(name, ...)                                                  \
  static void _mtl_call_##name() { __VA_ARGS__(); }                               \
  extern "C" __attribute__((visibility("default"))) void (*mtl_kernel_##name())() { return &_mtl_call_##name; }
#else
#define MTL_EXPORT_AS(name, ...) template decltype(__VA_ARGS__) __VA_ARGS__;
#endif
#if defined(MTL_CLCPP)
#define MTL_EXPORT(name)
#elif !defined(MTL_EXEC)
#define MTL_EXPORT(name) [[maybe_unused]] static void _mtl_call_##name() { name(); }
#endif
// metal::threadgroup_barrier etc. need the runtime in EXEC mode; declarations only otherwise.
#if defined(MTL_EXEC)
namespace metal {
inline void threadgroup_barrier(mem_flags) { mtl_rt::tg_barrier(); }
inline void simdgroup_barrier(mem_flags f) { uint z = 0; unsigned m; (void)_lanes(z, &m, 0xfffffffu); (void)f; }
} // namespace metal
#endif
