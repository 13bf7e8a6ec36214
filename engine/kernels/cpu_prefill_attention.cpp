// Prefill attention on CPU: many query tokens against their context, flash-attention style.
//
// infermesh_cpu::prefill_attention(q [n, Hq, D], k, v [m, Hkv, D], kv_head [Hq] int64, scale, causal)
//     -> (out [n, Hq, D] in q's dtype, lse [n, Hq] float32)
//
// causal: the queries are the context's last n tokens, query i sees keys 0 .. m - n + i; else every key.
// Rows may be strided (each row's heads dense). D is 16, 32, 64 or 128 (the wrapper, cpu_prefill.py,
// attends with torch otherwise).
//
// Work items are (query head, block of QB queries), longest first, taken by torch's intra-op threads as
// they free up. Each walks its visible keys in blocks of KB: scores for the block (float32), an online
// softmax (running max and sum per query), then the block's values weighted and added into float32 sums.
// Keys and values are laid out once per call for these products: on AVX512-BF16 (bf16 inputs) as bf16
// pairs for VDPBF16PS, keys [D / 2][KB] and values [KB / 2][D], so a query's pair or a weight pair is one
// broadcast against 16 keys or 16 dimensions (no horizontal sums); elsewhere in float32, keys [D][KB] and
// values [KB][D], with FMAs. The weights of a bf16 block are rounded to bf16 for the second product (as
// torch's flash attention does). An item's result depends on neither the thread count nor n's other rows.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using namespace infermesh_cpu;

constexpr int64_t QB = 64;  // queries of a work item
constexpr int64_t KB = 64;  // keys of a block: 4 vectors of 16 scores
constexpr int R = 4;        // queries whose scores a step keeps in registers (R x 4 sums)

// What a call needs to know about its inputs.
struct Problem {
  int64_t n, m, heads, kv_heads, dim, offset;  // offset: m - n when causal (query i sees keys <= offset + i)
  bool causal;
  float scale;
  int64_t blocks() const { return (m + KB - 1) / KB; }
  // keys query i may see: [0, visible(i))
  int64_t visible(int64_t i) const { return causal ? std::min(m, offset + i + 1) : m; }
};

// ---- online softmax over one block of scores (both paths) ----

#ifdef INFERMESH_AVX512
// e^x for x <= 0 (-inf included), 16 at a time, to ~3e-6 relative: 2^(x log2 e) as 2^n times 2^f, f in
// [-1/2, 1/2] by a degree-5 polynomial. For weights that are rounded to bf16 next (relative 4e-3), in half
// the instructions of exp_nonpositive.
inline f32x16 exp_for_bf16(f32x16 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps((__m512)x, _mm512_set1_ps(1.44269504088896341f)),
                                 _mm512_set1_ps(-150.f));  // below: 0 after scaling
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return (f32x16)_mm512_scalef_ps(p, n);
}
#endif

// Per query row: s [KB] scores (float32, scaled), of which the first `valid` are visible. Updates the row's
// running max and its 16 partial sums (added up once, at the end), returns the factor its value sums must be
// scaled by, and leaves e^(s - max) in s (0 past valid). BF16: the weights go on as bf16.
template <bool BF16>
inline float softmax_block(float* s, int64_t valid, float& row_max, float* row_sums) {
  if (valid <= 0) {
    std::fill(s, s + KB, 0.f);
    return 1.f;
  }
  std::fill(s + valid, s + KB, -INFINITY);
  const f32x16 x0 = load16(s), x1 = load16(s + 16), x2 = load16(s + 32), x3 = load16(s + 48);
  const f32x16 top01 = x0 > x1 ? x0 : x1, top23 = x2 > x3 ? x2 : x3;
  const float new_max = std::max(row_max, max16(top01 > top23 ? top01 : top23));
  const float alpha = new_max == row_max ? 1.f : row_max == -INFINITY ? 0.f : std::exp(row_max - new_max);
  auto weight = [new_max](f32x16 x) {
#ifdef INFERMESH_AVX512
    if constexpr (BF16) return exp_for_bf16(x - new_max);
#endif
    return x == -INFINITY ? 0 : exp_nonpositive(x - new_max);
  };
  const f32x16 p0 = weight(x0), p1 = weight(x1), p2 = weight(x2), p3 = weight(x3);
  store(s, p0), store(s + 16, p1), store(s + 32, p2), store(s + 48, p3);
  row_max = new_max;
  store(row_sums, load16(row_sums) * alpha + ((p0 + p1) + (p2 + p3)));
  return alpha;
}

// ---- float32 path (FMAs) ----

// keys [D][KB] and values [KB][D] of one block, float32, zero past the context.
template <typename T>
void lay_out_f32(const T* k, const T* v, int64_t stride, int64_t first, int64_t count, int64_t dim, float* keys,
                 float* values) {
  std::fill(keys, keys + dim * KB, 0.f);
  std::fill(values, values + KB * dim, 0.f);
  for (int64_t j = 0; j < count; ++j) {
    const T* kr = k + (first + j) * stride;
    const T* vr = v + (first + j) * stride;
    for (int64_t d = 0; d < dim; ++d) keys[d * KB + j] = to_float(kr[d]), values[j * dim + d] = to_float(vr[d]);
  }
}

// s [R][KB] = scale x the R queries q [R][D] (float32) times the block's keys [D][KB].
inline void scores_f32(const float* q, int64_t dim, const float* keys, float scale, float* s) {
  f32x16 c00 = {}, c01 = {}, c02 = {}, c03 = {}, c10 = {}, c11 = {}, c12 = {}, c13 = {};
  f32x16 c20 = {}, c21 = {}, c22 = {}, c23 = {}, c30 = {}, c31 = {}, c32 = {}, c33 = {};  // c<query><16 keys>
  for (int64_t d = 0; d < dim; ++d) {
    const f32x16 k0 = load16(keys + d * KB), k1 = load16(keys + d * KB + 16);
    const f32x16 k2 = load16(keys + d * KB + 32), k3 = load16(keys + d * KB + 48);
    float w = q[d];
    c00 += w * k0, c01 += w * k1, c02 += w * k2, c03 += w * k3;
    w = q[dim + d];
    c10 += w * k0, c11 += w * k1, c12 += w * k2, c13 += w * k3;
    w = q[2 * dim + d];
    c20 += w * k0, c21 += w * k1, c22 += w * k2, c23 += w * k3;
    w = q[3 * dim + d];
    c30 += w * k0, c31 += w * k1, c32 += w * k2, c33 += w * k3;
  }
  const f32x16 all[16] = {c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33};
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) store(s + 16 * j, all[j] * scale);
}

// o [R][D] += weights p [R][KB] times the block's values [KB][D]; V = D / 16.
template <int V>
void weigh_f32(const float* p, const float* values, float* o) {
  constexpr int ROWS = 16 / V < R ? 16 / V : R;  // accumulators in registers: ROWS x V
  for (int r0 = 0; r0 < R; r0 += ROWS) {
    f32x16 acc[ROWS][V];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[r][j] = load16(o + (r0 + r) * V * 16 + 16 * j);
    for (int64_t t = 0; t < KB; ++t) {
      f32x16 val[V];
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) val[j] = load16(values + t * V * 16 + 16 * j);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const float w = p[(r0 + r) * KB + t];
#pragma GCC unroll 8
        for (int j = 0; j < V; ++j) acc[r][j] += w * val[j];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) store(o + (r0 + r) * V * 16 + 16 * j, acc[r][j]);
  }
}

// ---- bf16 path (AVX512-BF16 dot products) ----

#ifdef INFERMESH_BF16_DOT

inline uint32_t pair(c10::BFloat16 lo, c10::BFloat16 hi) { return lo.x | static_cast<uint32_t>(hi.x) << 16; }

// keys [D / 2][KB] (dims 2d, 2d + 1 of a key as one pair) and values [KB / 2][D] (keys 2t, 2t + 1 of a
// dimension as one pair) of one block, zero past the context.
void lay_out_pairs(const c10::BFloat16* k, const c10::BFloat16* v, int64_t stride, int64_t first, int64_t count,
                   int64_t dim, uint32_t* keys, uint32_t* values) {
  std::fill(keys, keys + dim / 2 * KB, 0u);
  std::fill(values, values + KB / 2 * dim, 0u);
  const c10::BFloat16 zero = c10::BFloat16(0.f);
  for (int64_t j = 0; j < count; ++j) {
    const c10::BFloat16* kr = k + (first + j) * stride;
    for (int64_t d = 0; d < dim / 2; ++d) keys[d * KB + j] = pair(kr[2 * d], kr[2 * d + 1]);
  }
  for (int64_t t = 0; 2 * t < count; ++t) {
    const c10::BFloat16* v0 = v + (first + 2 * t) * stride;
    const c10::BFloat16* v1 = 2 * t + 1 < count ? v0 + stride : nullptr;
    for (int64_t d = 0; d < dim; ++d) values[t * dim + d] = pair(v0[d], v1 ? v1[d] : zero);
  }
}

// s [R][KB] = scale x the R queries q [R][D / 2] (bf16 pairs) times the block's keys [D / 2][KB].
inline void scores_pairs(const uint32_t* q, int64_t dim, const uint32_t* keys, float scale, float* s) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
  __m512 c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    const uint32_t* kd = keys + d * KB;
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kd), k1 = (__m512bh)_mm512_loadu_si512(kd + 16);
    const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kd + 32), k3 = (__m512bh)_mm512_loadu_si512(kd + 48);
    __m512bh w = (__m512bh)_mm512_set1_epi32(q[d]);
    c00 = _mm512_dpbf16_ps(c00, w, k0), c01 = _mm512_dpbf16_ps(c01, w, k1);
    c02 = _mm512_dpbf16_ps(c02, w, k2), c03 = _mm512_dpbf16_ps(c03, w, k3);
    w = (__m512bh)_mm512_set1_epi32(q[half + d]);
    c10 = _mm512_dpbf16_ps(c10, w, k0), c11 = _mm512_dpbf16_ps(c11, w, k1);
    c12 = _mm512_dpbf16_ps(c12, w, k2), c13 = _mm512_dpbf16_ps(c13, w, k3);
    w = (__m512bh)_mm512_set1_epi32(q[2 * half + d]);
    c20 = _mm512_dpbf16_ps(c20, w, k0), c21 = _mm512_dpbf16_ps(c21, w, k1);
    c22 = _mm512_dpbf16_ps(c22, w, k2), c23 = _mm512_dpbf16_ps(c23, w, k3);
    w = (__m512bh)_mm512_set1_epi32(q[3 * half + d]);
    c30 = _mm512_dpbf16_ps(c30, w, k0), c31 = _mm512_dpbf16_ps(c31, w, k1);
    c32 = _mm512_dpbf16_ps(c32, w, k2), c33 = _mm512_dpbf16_ps(c33, w, k3);
  }
  const __m512 all[16] = {c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33};
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(s + 16 * j, _mm512_mul_ps(all[j], _mm512_set1_ps(scale)));
}

// o [R][D] += weights p [R][KB / 2] (bf16 pairs) times the block's values [KB / 2][D]; V = D / 16.
template <int V>
void weigh_pairs(const uint32_t* p, const uint32_t* values, float* o) {
  constexpr int ROWS = 16 / V < R ? 16 / V : R;  // accumulators in registers: ROWS x V
  for (int r0 = 0; r0 < R; r0 += ROWS) {
    __m512 acc[ROWS][V];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_loadu_ps(o + (r0 + r) * V * 16 + 16 * j);
    for (int64_t t = 0; t < KB / 2; ++t) {
      __m512bh val[V];
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) val[j] = (__m512bh)_mm512_loadu_si512(values + t * V * 16 + 16 * j);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(p[(r0 + r) * KB / 2 + t]);
#pragma GCC unroll 8
        for (int j = 0; j < V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w, val[j]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) _mm512_storeu_ps(o + (r0 + r) * V * 16 + 16 * j, acc[r][j]);
  }
}
#endif

template <typename T>
void lay_out(const T* k, const T* v, int64_t stride, int64_t first, int64_t count, int64_t dim, float* keys,
             float* values) {
  lay_out_f32(k, v, stride, first, count, dim, keys, values);
}
#ifdef INFERMESH_BF16_DOT
inline void lay_out(const c10::BFloat16* k, const c10::BFloat16* v, int64_t stride, int64_t first, int64_t count,
                    int64_t dim, uint32_t* keys, uint32_t* values) {
  lay_out_pairs(k, v, stride, first, count, dim, keys, values);
}
#endif

// ---- one work item: QB queries of one head against their visible keys ----

struct Scratch {
  std::vector<float> s, o, q, row_max, row_sums;  // [QB][KB], [QB][D], [QB][D] float32 queries, [QB], [QB][16]
  std::vector<uint32_t> q_pairs, p_pairs;        // [QB][D / 2], [QB][KB / 2] (the bf16 path)
  Scratch(int64_t dim) : s(QB * KB), o(QB * dim), q(QB * dim), row_max(QB), row_sums(QB * 16), q_pairs(QB * dim / 2),
                         p_pairs(QB * KB / 2) {}
};

// The item's rows [first, first + rows) of head h; keys and values: this KV head's blocks as laid out.
template <int V, bool DOT, typename T, typename Laid>
void attend_item(const Problem& pb, const T* q, int64_t q_stride, int64_t h, int64_t first, int64_t rows,
                 const Laid* keys, const Laid* values, Scratch& w, T* out, int64_t out_stride, float* lse) {
  const int64_t dim = pb.dim, padded = (rows + R - 1) / R * R;  // rows past `rows` are copies of the last
  std::fill(w.o.begin(), w.o.end(), 0.f);
  std::fill(w.row_max.begin(), w.row_max.end(), -INFINITY);
  std::fill(w.row_sums.begin(), w.row_sums.end(), 0.f);
  for (int64_t i = 0; i < padded; ++i) {
    const T* qr = q + (first + std::min(i, rows - 1)) * q_stride + h * dim;
    if constexpr (DOT) {
      std::memcpy(w.q_pairs.data() + i * dim / 2, qr, dim * sizeof(T));
    } else {
      for (int64_t d = 0; d < dim; ++d) w.q[i * dim + d] = to_float(qr[d]);
    }
  }
  const int64_t last_key = pb.visible(first + rows - 1), blocks = (last_key + KB - 1) / KB;
  const int64_t block_size = DOT ? dim / 2 * KB : dim * KB;  // laid-out elements of a block's keys (or values)
  for (int64_t b = 0; b < blocks; ++b) {
    const Laid* kb = keys + b * block_size;
    const Laid* vb = values + b * block_size;
    for (int64_t i = 0; i < padded; i += R) {
#ifdef INFERMESH_BF16_DOT
      if constexpr (DOT) scores_pairs(w.q_pairs.data() + i * dim / 2, dim, kb, pb.scale, w.s.data() + i * KB);
      else
#endif
        scores_f32(w.q.data() + i * dim, dim, reinterpret_cast<const float*>(kb), pb.scale, w.s.data() + i * KB);
    }
    for (int64_t i = 0; i < padded; ++i) {
      float* s = w.s.data() + i * KB;
      const int64_t valid = i < rows ? pb.visible(first + i) - b * KB : 0;
      const float alpha = softmax_block<DOT>(s, std::min(valid, KB), w.row_max[i], w.row_sums.data() + 16 * i);
      if (alpha != 1.f) {
        float* o = w.o.data() + i * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] *= alpha;
      }
#ifdef INFERMESH_BF16_DOT
      if constexpr (DOT) {  // the weights as bf16 pairs
        uint32_t* p = w.p_pairs.data() + i * KB / 2;
        for (int64_t j = 0; j < KB; j += 32)
          _mm512_storeu_si512(p + j / 2,
                              (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + j + 16), _mm512_loadu_ps(s + j)));
      }
#endif
    }
    for (int64_t i = 0; i < padded; i += R) {
#ifdef INFERMESH_BF16_DOT
      if constexpr (DOT) weigh_pairs<V>(w.p_pairs.data() + i * KB / 2, vb, w.o.data() + i * dim);
      else
#endif
        weigh_f32<V>(w.s.data() + i * KB, reinterpret_cast<const float*>(vb), w.o.data() + i * dim);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float sum = sum16(load16(w.row_sums.data() + 16 * i)), inv = 1.f / sum;
    const float* o = w.o.data() + i * dim;
    T* dst = out + (first + i) * out_stride + h * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(o[d] * inv);
    lse[(first + i) * pb.heads + h] = w.row_max[i] + std::log(sum);
  }
}

// Items (head, query block) over the threads, the ones with the most keys first, each taken by whichever
// thread frees up (a causal item's cost grows with its block).
// f(head, query block, the thread's scratch).
template <typename F>
void for_each_item(int64_t heads, int64_t query_blocks, bool causal, int64_t dim, const F& f) {
  const int64_t items = heads * query_blocks;
  auto take = [&](int64_t index, Scratch& w) {  // causal: the last blocks first
    const int64_t block = index / heads;
    f(index % heads, causal ? query_blocks - 1 - block : block, w);
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  if (threads <= 1 || omp_in_parallel()) {
    Scratch w(dim);
    for (int64_t i = 0; i < items; ++i) take(i, w);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    Scratch w(dim);
    for (int64_t i = next++; i < items; i = next++) take(i, w);
  }
}

template <int V, bool DOT, typename T>
void run(const Problem& pb, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* kv_head,
         at::Tensor& out, at::Tensor& lse) {
  using Laid = std::conditional_t<DOT, uint32_t, float>;
  const int64_t blocks = pb.blocks(), block_size = DOT ? pb.dim / 2 * KB : pb.dim * KB;
  std::vector<Laid> keys(pb.kv_heads * blocks * block_size), values(pb.kv_heads * blocks * block_size);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  parallel_for(pb.kv_heads * blocks, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, b = item % blocks, at = item * block_size;
      lay_out(kp + g * pb.dim, vp + g * pb.dim, k.stride(0), b * KB, std::min(KB, pb.m - b * KB), pb.dim,
              keys.data() + at, values.data() + at);
    }
  });
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  for_each_item(pb.heads, (pb.n + QB - 1) / QB, pb.causal, pb.dim, [&](int64_t h, int64_t block, Scratch& w) {
    const int64_t first = block * QB, rows = std::min(QB, pb.n - first), at = kv_head[h] * blocks * block_size;
    attend_item<V, DOT>(pb, qp, q.stride(0), h, first, rows, keys.data() + at, values.data() + at, w, op,
                        out.stride(0), lp);
  });
}

template <int V, typename T>
void run_path(const Problem& pb, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const int64_t* kv_head, at::Tensor& out, at::Tensor& lse) {
#ifdef INFERMESH_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16> && V % 2 == 0) {
    if (bf16_path() != Bf16Path::fma) return run<V, true, T>(pb, q, k, v, kv_head, out, lse);
  }
#endif
  run<V, false, T>(pb, q, k, v, kv_head, out, lse);
}

std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& kv_head, double scale, bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q must be [n, Hq, D] and k, v [m, Hkv, D], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && v.scalar_type() == k.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(k.stride(0) == v.stride(0), "k and v must share a row stride");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "each row's heads must be dense, got strides ",
                t->strides());
  const int64_t dim = q.size(2);
  TORCH_CHECK(k.size(2) == dim && (dim == 16 || dim == 32 || dim == 64 || dim == 128), "head_dim must be 16, 32, 64 "
              "or 128 and the same in q and k, got ", dim, " and ", k.size(2));
  TORCH_CHECK(kv_head.dim() == 1 && kv_head.size(0) == q.size(1) && kv_head.scalar_type() == at::kLong &&
                  kv_head.is_contiguous(), "kv_head must be [", q.size(1), "] int64");
  const int64_t* hp = kv_head.data_ptr<int64_t>();
  for (int64_t h = 0; h < q.size(1); ++h)
    TORCH_CHECK(hp[h] >= 0 && hp[h] < k.size(1), "kv_head[", h, "] = ", hp[h], " is not in [0, ", k.size(1), ")");
  TORCH_CHECK(k.size(0) >= 1 && (!causal || k.size(0) >= q.size(0)), "causal attention needs at least as many keys ",
              "as queries, got ", k.size(0), " keys for ", q.size(0), " queries");
  const Problem pb{q.size(0), k.size(0), q.size(1), k.size(1), dim, k.size(0) - q.size(0), causal,
                   static_cast<float>(scale)};
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.size(0) == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    switch (dim) {
      case 16: return run_path<1, scalar_t>(pb, q, k, v, hp, out, lse);
      case 32: return run_path<2, scalar_t>(pb, q, k, v, hp, out, lse);
      case 64: return run_path<4, scalar_t>(pb, q, k, v, hp, out, lse);
      default: return run_path<8, scalar_t>(pb, q, k, v, hp, out, lse);
    }
  });
  return {out, lse};
}

}  // namespace

namespace infermesh_cpu::direct {
std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& kv_head, double scale, bool causal) {
  return ::prefill_attention(q, k, v, kv_head, scale, causal);
}
}  // namespace infermesh_cpu::direct

TORCH_LIBRARY_FRAGMENT(infermesh_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor kv_head, float scale, bool causal) -> "
        "(Tensor, Tensor)", &prefill_attention);
}
