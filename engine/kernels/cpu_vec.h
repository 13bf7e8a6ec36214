// What the CPU kernels share: float32 vectors of 16 lanes (or 8: `f32xN`) over the model's dtypes, RoPE on
// one head, and a parallel loop on the calling thread's intra-op threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include "cpu_features.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace infermesh_cpu {

// 16 floats as one vector (GCC/Clang vector extensions: one AVX-512 register where the CPU has them, two
// AVX2 or four NEON registers elsewhere).
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

// The integer lanes beside a float vector of 16 or 8 lanes.
template <typename F>
struct lanes;
template <>
struct lanes<f32x16> {
  using i32 = i32x16;
  using u32 = u32x16;
  using u16 = u16x16;
  static constexpr int n = 16;
};
template <>
struct lanes<f32x8> {
  using i32 = i32x8;
  using u32 = u32x8;
  using u16 = u16x8;
  static constexpr int n = 8;
};

// The float vector of a row-wise loop on this CPU: 16 lanes with AVX-512; else 8, one AVX2 register (a loop
// over 16-lane vectors there spilled through the stack and ran ~10x slower than memory).
#ifdef INFERMESH_AVX512
using f32xN = f32x16;
#else
using f32xN = f32x8;
#endif

inline float to_float(int8_t x) { return x; }
inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }

template <typename T>
inline f32x16 load16(const T* p) {
  f32x16 v;
  for (int j = 0; j < 16; ++j) v[j] = to_float(p[j]);
  return v;
}
template <>
inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <>
inline f32x16 load16(const c10::BFloat16* p) {  // bf16 is the top half of a float32
#ifdef INFERMESH_AVX512  // one widening load (GCC widens a vector of 16 in two halves)
  return (f32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  u16x16 bits;
  std::memcpy(&bits, p, sizeof bits);
  return (f32x16)(__builtin_convertvector(bits, u32x16) << 16);
#endif
}

inline float sum16(f32x16 v) {  // halve and add: in registers with GCC >= 12 or Clang, through memory before
#if defined(__clang__) || __GNUC__ >= 12
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
  f32x8 a, a_hi;
  std::memcpy(&a, &v, sizeof a);
  std::memcpy(&a_hi, reinterpret_cast<const char*>(&v) + sizeof a, sizeof a_hi);
  a += a_hi;
  f32x4 b, b_hi;
  std::memcpy(&b, &a, sizeof b);
  std::memcpy(&b_hi, reinterpret_cast<const char*>(&a) + sizeof b, sizeof b_hi);
  b += b_hi;
#endif
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#ifdef INFERMESH_AVX512
// The 16 vectors' sums, each added in sum16's order (halves, quarters, then (b0 + b2) + (b1 + b3)) but 16 at
// once: lane 4 c + j of the result is the sum of v[4 j + c].
__attribute__((always_inline)) inline __m512 sum16x16(const __m512 (&v)[16]) {
  __m512 halves[8], quarters[4];
  for (int i = 0; i < 8; ++i)  // [v[2i] lanes 0-7 + 8-15, v[2i+1] the same]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit chunk c: v[4i + c]'s lanes 0-3 + 4-7
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  // in each chunk c, four vectors' quarters b: (b0 + b2) + (b1 + b3)
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(quarters[0], quarters[1]),
                                 _mm512_unpackhi_ps(quarters[0], quarters[1]));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2], quarters[3]),
                                 _mm512_unpackhi_ps(quarters[2], quarters[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
#endif

// ---- 8 lanes: where there is no AVX-512, GCC keeps a vector of 16 floats in two registers and moves their
// halves through the stack, so the kernels' AVX2
// code works on vectors of 8, each 16-lane sum as its lanes 0-7 and 8-15 (same bits, lane by lane) ----

template <typename T>
inline f32x8 load8(const T* p) {
  f32x8 v;
  for (int j = 0; j < 8; ++j) v[j] = to_float(p[j]);
  return v;
}
template <>
inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#ifdef INFERMESH_AVX2
template <>
inline f32x8 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  return (f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
}
#endif

// a * b + c rounded once, written out: GCC leaves `c += a * b` a multiply and an add in some inlined contexts
// and not in others, which gives one sum other bits in another caller
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) {
#ifdef INFERMESH_FMA
  return (f32x8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline float sum8(f32x8 a) {  // sum16's order from its halves' sum: quarters, then (b0 + b2) + (b1 + b3)
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float max16(f32x16 v) {
#ifdef INFERMESH_AVX512
  return _mm512_reduce_max_ps((__m512)v);
#else
  float m = v[0];
  for (int j = 1; j < 16; ++j) m = std::max(m, v[j]);
  return m;
#endif
}

// e^x for x <= 0 (scores minus their maximum), 16 (or 8: F = f32x8, I = i32x8) at a time: Cephes' polynomial
// after range reduction, ~1 ulp.
template <typename F = f32x16, typename I = i32x16>
inline F exp_nonpositive(F x) {
  const F floor = x * 0 - 87.0f;
  x = x < floor ? floor : x;
  const I whole = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I);  // round(x log2 e), x <= 0
  const F n = __builtin_convertvector(whole, F);
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * (F)((whole + 127) << 23);
}

// v rounded to T's precision (RNE, as torch rounds each op's result), still as float32 lanes (16 or 8).
template <typename T, typename F>
inline F rounded(F v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // c10::BFloat16's rounding, every lane at once
    using U = typename lanes<F>::u32;
    const U bits = (U)v;
    const U even = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    const U nan = U{} + 0x7FC00000u;  // the one bf16 NaN c10 rounds every NaN to
    return (F)((bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : even);
  } else {
    for (int j = 0; j < lanes<F>::n; ++j) v[j] = to_float(static_cast<T>(v[j]));
    return v;
  }
}

// v's lanes stored as T, rounded as `rounded` rounds them.
template <typename T, typename F>
inline void store(T* p, F v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the top half of each rounded float32
    const auto bits = __builtin_convertvector((typename lanes<F>::u32)rounded<T>(v) >> 16, typename lanes<F>::u16);
    std::memcpy(p, &bits, sizeof bits);
  } else {
    for (int j = 0; j < lanes<F>::n; ++j) p[j] = static_cast<T>(v[j]);
  }
}

// load16 or load8, by the vector asked for.
template <typename F, typename T>
inline F load(const T* p) {
  if constexpr (lanes<F>::n == 16) return load16(p);
  else return load8(p);
}

// One head of one token: x = (x1, x2) -> (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2), each product and the sum
// rounded to T as torch's `x * cos + rotate_half(x) * sin` rounds them.
template <typename T>
inline void rotate(T* x, const T* cos, const T* sin, int64_t half) {
  using F = f32xN;
  int64_t i = 0;
  for (; i + lanes<F>::n <= half; i += lanes<F>::n) {
    const F x1 = load<F>(x + i), x2 = load<F>(x + half + i);
    const F out1 = rounded<T>(x1 * load<F>(cos + i)) - rounded<T>(x2 * load<F>(sin + i));
    const F out2 = rounded<T>(x2 * load<F>(cos + half + i)) + rounded<T>(x1 * load<F>(sin + half + i));
    store(x + i, out1);
    store(x + half + i, out2);
  }
  for (; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
    x[i] = static_cast<T>(to_float(static_cast<T>(x1 * to_float(cos[i]))) -
                          to_float(static_cast<T>(x2 * to_float(sin[i]))));
    x[half + i] = static_cast<T>(to_float(static_cast<T>(x2 * to_float(cos[half + i]))) +
                                 to_float(static_cast<T>(x1 * to_float(sin[half + i]))));
  }
}

// f(begin, end) over [0, n) in contiguous ranges, one per intra-op thread of the calling thread. Not
// at::parallel_for: compiled into this library, its "first parallel region on this thread" set-up would give
// the calling thread the count last set on any thread (a gRPC handler's 1, say), not its own.
template <typename F>
void parallel_for(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || omp_in_parallel()) return f(0, n);
#pragma omp parallel num_threads(threads)
  {
    const int64_t per = (n + threads - 1) / threads, begin = omp_get_thread_num() * per;
    if (begin < n) f(begin, std::min(n, begin + per));
  }
}

// Which path bf16 products take (cpu_linear.cpp): the fastest this CPU has, or a slower one where
// INFERMESH_CPU_BF16 caps it. Float32 and half always take fma.
enum class Bf16Path { fma, dot, amx };  // slowest to fastest
Bf16Path bf16_path();

// The ops cpu_step_layers.cpp chains in one call, called there without the dispatcher: each is its op's own
// function, exported from the op's file.
namespace direct {
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, bool batch_invariant);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
at::Tensor decode_attention(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& tables,
                            const at::Tensor& lens, const at::Tensor& kv_heads, double scale, int64_t heads);
at::Tensor rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& kv_heads, double scale);
std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& kv_head, double scale, bool causal);
}  // namespace direct

}  // namespace infermesh_cpu
