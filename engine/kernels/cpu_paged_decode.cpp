// Paged decode attention on CPU: one query token per sequence, read straight from the paged KV cache.
//
// infermesh_cpu::paged_decode(q [B, Hq, D], k_cache, v_cache [blocks, block_size, Hkv, D],
//                             block_tables [B, max_blocks] int64, context_lens [B] int32,
//                             kv_head [Hq] int64, scale) -> [B, Hq, D]
// infermesh_cpu::decode_attention(qkv [B, >= (Hq + 2 Hkv) D], cos, sin, k_cache, v_cache, slot_mapping [B],
//                                 block_tables, context_lens, kv_head, scale, Hq) -> [B, Hq * D]: a decode-only
//                                 step's RoPE, cache write and the same attention in one call (engine.attention,
//                                 fused_decode)
//
// Work items are (sequence, chunk of CHUNK tokens), spread over torch's intra-op threads. Each item walks its tokens
// through the block table (no gather of the context), reads each KV head's part of a row once for all the query heads
// that share it, with rows prefetched ahead, and keeps float32 partials: scores, softmax numerators and the weighted
// sum of values (bf16 scores on AVX512-BF16 dot products where the CPU has them). The chunks of a sequence are then
// merged by log-sum-exp in chunk order (a sequence of one chunk by its item). Chunks are fixed in size, so a sequence's
// result does not depend on the batch it runs in or the number of threads. paged_decode's shapes and dtypes are checked
// by its Python wrapper (engine/kernels/cpu_decode.py), decode_attention's here, and the block tables, lengths and
// slots here: every row read or written lies in the cache.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using namespace infermesh_cpu;

constexpr int64_t CHUNK = 256;

// scores [n], in a buffer of whole 16-lane vectors -> e^(score - max) in place (0 past n); returns (max,
// their sum).
#ifdef INFERMESH_AVX512
inline std::pair<float, float> softmax_numerators(float* scores, int64_t n) {
  const int64_t padded = (n + 15) / 16 * 16;
  std::fill(scores + n, scores + padded, -INFINITY);
  f32x16 x, top;
  std::memcpy(&top, scores, sizeof top);
  for (int64_t i = 16; i < padded; i += 16) {
    std::memcpy(&x, scores + i, sizeof x);
    top = x > top ? x : top;
  }
  const float m = max16(top);
  f32x16 sum = {};
  for (int64_t i = 0; i < padded; i += 16) {
    std::memcpy(&x, scores + i, sizeof x);
    x = x == -INFINITY ? 0 : exp_nonpositive(x - m);
    std::memcpy(scores + i, &x, sizeof x);
    sum += x;
  }
  return {m, sum16(sum)};
}
#else
// The same on vectors of 8 (the sum's 16 lanes as two halves).
inline std::pair<float, float> softmax_numerators(float* scores, int64_t n) {
  const int64_t padded = (n + 15) / 16 * 16;
  std::fill(scores + n, scores + padded, -INFINITY);
  f32x8 top = load8(scores);
  for (int64_t i = 8; i < padded; i += 8) {
    const f32x8 x = load8(scores + i);
    top = x > top ? x : top;
  }
  float m = top[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, top[j]);
  f32x8 low = {}, high = {};
  for (int64_t i = 0; i < padded; i += 16) {
    f32x8 x[2] = {load8(scores + i), load8(scores + i + 8)};
    for (f32x8& h : x) h = h == -INFINITY ? 0 : exp_nonpositive<f32x8, i32x8>(h - m);
    std::memcpy(scores + i, x, sizeof x);
    low += x[0], high += x[1];
  }
  return {m, sum8(low + high)};
}
#endif

// Rows prefetched ahead of the one in use (a KV head's part of a row is strided, which the hardware
// prefetcher follows poorly): 19-20 -> 10-12 ms for 30 layers of 6,000 tokens on 2 cores.
// Into L2, not L1: L1 has too few misses in flight for 32 rows of 2 lines each (AMD Zen 4: 9.3-10.2 ->
// 7.7-7.9 ms at 1 x 6,000 tokens, 11.9-12.8 -> 8.4-8.9 at 32 x 200).
// The AVX-512 loops then bring the rows they are about to read from L2 into L1 as well (bf16: the next 16
// keys, the value 8 rows on): 3-5 % off 30 layers at 1 x 6,000, 8 x 1,000 and 32 x 200 on a CPU with AMX tiles.
constexpr int64_t AHEAD = 32, NEAR = 8;

template <int LEVEL = 2>  // 2: into L2, 3: into L1 (__builtin_prefetch's locality)
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, LEVEL);
}

// scores [p * CHUNK + i] = scale * (q[p] . key i) for P query heads over n cache rows, one row at a time:
// its 16-lane products reduced by sum16 for each head. V = D / 16 at compile time.
#ifdef INFERMESH_AVX512
template <int V, int P, typename T>
void scores_of(const float* const* q, const T* keys, const int64_t* rows, int64_t n, float scale, float* scores) {
  f32x16 query[P][V];
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < V; ++j) query[p][j] = load16(q[p] + 16 * j) * scale;
  for (int64_t i = 0; i < n; ++i) {
    const T* k = keys + rows[i];
    if (i + AHEAD < n) prefetch_row(keys + rows[i + AHEAD], V * 16 * sizeof(T));
    f32x16 key[V];
    for (int j = 0; j < V; ++j) key[j] = load16(k + 16 * j);
    for (int p = 0; p < P; ++p) {
      f32x16 dot = query[p][0] * key[0];
      for (int j = 1; j < V; ++j) dot += query[p][j] * key[j];
      scores[p * CHUNK + i] = sum16(dot);
    }
  }
}
#else
// The same sums on vectors of 8 (each 16-lane vector as its halves): the key's 2 V halves in registers, the
// scaled queries read from cache by the FMAs (P V 16-lane queries would not fit AVX2's 16 registers).
template <int V, int P, typename T>
void scores_of(const float* const* q, const T* keys, const int64_t* rows, int64_t n, float scale, float* scores) {
  alignas(32) float query[P][16 * V];
  for (int p = 0; p < P; ++p)
    for (int d = 0; d < 16 * V; ++d) query[p][d] = q[p][d] * scale;
  for (int64_t i = 0; i < n; ++i) {
    const T* k = keys + rows[i];
    if (i + AHEAD < n) prefetch_row(keys + rows[i + AHEAD], V * 16 * sizeof(T));
    f32x8 key[2 * V];
    for (int h = 0; h < 2 * V; ++h) key[h] = load8(k + 8 * h);
    for (int p = 0; p < P; ++p) {
      f32x8 low = load8(query[p]) * key[0], high = load8(query[p] + 8) * key[1];
      for (int j = 1; j < V; ++j) {
        low = fma8(load8(query[p] + 16 * j), key[2 * j], low);
        high = fma8(load8(query[p] + 16 * j + 8), key[2 * j + 1], high);
      }
      scores[p * CHUNK + i] = sum8(low + high);
    }
  }
}
#endif

#ifdef INFERMESH_BF16_DOT
// The same over bf16 on AVX512-BF16 dot products (VDPBF16PS: bf16 pairs multiplied exactly, summed into
// 16 float32 lanes; the queries are bf16 values, so exact in bf16), 16 rows at a time: their 16 sums reduced
// together (sum16x16), not one by one. Written up to n rounded up to 16 (past n: unused). Capped to fma
// (INFERMESH_CPU_BF16), the rows above.
template <int V, int P>
void scores_of(const float* const* q, const c10::BFloat16* keys, const int64_t* rows, int64_t n, float scale,
               float* scores) {
  if (bf16_path() == Bf16Path::fma) return scores_of<V, P, c10::BFloat16>(q, keys, rows, n, scale, scores);
  constexpr int STEPS = V / 2;  // 32 bf16 of a row per dot product
  __m512bh query[P][STEPS];
  for (int p = 0; p < P; ++p)
    for (int s = 0; s < STEPS; ++s)
      query[p][s] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q[p] + 32 * s + 16), _mm512_loadu_ps(q[p] + 32 * s));
  const __m512i in_row_order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  for (int64_t i = 0; i < n; i += 16) {
    const c10::BFloat16* key[16];
    for (int t = 0; t < 16; ++t) key[t] = keys + rows[std::min<int64_t>(i + t, n - 1)];  // past n: a repeat
    for (int64_t t = i + AHEAD; t < std::min<int64_t>(i + AHEAD + 16, n); ++t)
      prefetch_row(keys + rows[t], V * 16 * sizeof(c10::BFloat16));
    for (int64_t t = i + 16; t < std::min<int64_t>(i + 32, n); ++t) prefetch_row<3>(keys + rows[t], V * 16 * 2);
    for (int p = 0; p < P; ++p) {
      __m512 dots[16];
      for (int t = 0; t < 16; ++t) {
        dots[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[p][0], (__m512bh)_mm512_loadu_si512(key[t]));
        for (int s = 1; s < STEPS; ++s)
          dots[t] = _mm512_dpbf16_ps(dots[t], query[p][s], (__m512bh)_mm512_loadu_si512(key[t] + 32 * s));
      }
      // lane 4 c + j of sum16x16 is row 4 j + c
      const __m512 sums = _mm512_permutexvar_ps(in_row_order, sum16x16(dots));
      _mm512_storeu_ps(scores + p * CHUNK + i, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
    }
  }
}
#endif

// P query heads q [P, D] that share one KV head, over n cache rows (keys + rows[i], values + rows[i]):
// out [P, D] = the sum of the rows' values weighted by e^(score - max); stats [P] = (max, sum of weights).
// V = D / 16 at compile time, so the P outputs stay in registers while each row is read once for all P heads.
#ifdef INFERMESH_AVX512
template <int V, int P, typename T>
void attend_heads(const float* const* q, const T* keys, const T* values, const int64_t* rows, int64_t n,
                  float scale, float* scores, float* const* out, std::pair<float, float>* stats) {
  scores_of<V, P>(q, keys, rows, n, scale, scores);
  for (int p = 0; p < P; ++p) stats[p] = softmax_numerators(scores + p * CHUNK, n);
  // named, not an array: GCC keeps an array of sums in memory
  for (int j0 = 0; j0 < V; j0 += 4) {  // 4 slices of 16 lanes at a time: 4 P sums in registers
    f32x16 a00 = {}, a01 = {}, a02 = {}, a03 = {}, a10 = {}, a11 = {}, a12 = {}, a13 = {};
    f32x16 a20 = {}, a21 = {}, a22 = {}, a23 = {}, a30 = {}, a31 = {}, a32 = {}, a33 = {};  // a<head><slice>
    for (int64_t i = 0; i < n; ++i) {
      const T* v = values + rows[i] + 16 * j0;
      if (i + AHEAD < n) prefetch_row(values + rows[i + AHEAD] + 16 * j0, 64 * sizeof(T));
      if (i + NEAR < n) prefetch_row<3>(values + rows[i + NEAR] + 16 * j0, 64 * sizeof(T));
      const f32x16 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
      const float w0 = scores[i];
      a00 += w0 * v0, a01 += w0 * v1, a02 += w0 * v2, a03 += w0 * v3;
      if constexpr (P > 1) {
        const float w = scores[CHUNK + i];
        a10 += w * v0, a11 += w * v1, a12 += w * v2, a13 += w * v3;
      }
      if constexpr (P > 2) {
        const float w = scores[2 * CHUNK + i];
        a20 += w * v0, a21 += w * v1, a22 += w * v2, a23 += w * v3;
      }
      if constexpr (P > 3) {
        const float w = scores[3 * CHUNK + i];
        a30 += w * v0, a31 += w * v1, a32 += w * v2, a33 += w * v3;
      }
    }
    const f32x16 sums[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}};
    for (int p = 0; p < P; ++p) std::memcpy(out[p] + 16 * j0, sums[p], sizeof sums[p]);
  }
}
#else
// The same on vectors of 8 (each lane's sum in the same order): 2 slices of 8 lanes a pass, so the P heads'
// 2 P sums, the slices of a value row and the P weights fit AVX2's 16 registers; the passes go over blocks of
// ROWS rows, whose values stay in L1 after the first pass (which prefetches whole rows ahead), the sums kept
// in `out` between blocks.
template <int V, int P, typename T>
void attend_heads(const float* const* q, const T* keys, const T* values, const int64_t* rows, int64_t n,
                  float scale, float* scores, float* const* out, std::pair<float, float>* stats) {
  scores_of<V, P>(q, keys, rows, n, scale, scores);
  for (int p = 0; p < P; ++p) stats[p] = softmax_numerators(scores + p * CHUNK, n);
  constexpr int SLICES = 2;
  constexpr int64_t ROWS = 64;
  for (int p = 0; p < P; ++p) std::fill(out[p], out[p] + 16 * V, 0.f);
  for (int64_t first = 0; first < n; first += ROWS) {
    const int64_t last = std::min(n, first + ROWS);
    for (int j0 = 0; j0 < 2 * V; j0 += SLICES) {
      f32x8 sums[P][SLICES];
      for (int p = 0; p < P; ++p)
        for (int s = 0; s < SLICES; ++s) sums[p][s] = load8(out[p] + 8 * (j0 + s));
      for (int64_t i = first; i < last; ++i) {
        const T* v = values + rows[i] + 8 * j0;
        if (j0 == 0 && i + AHEAD < n) prefetch_row(values + rows[i + AHEAD], V * 16 * sizeof(T));
        f32x8 slice[SLICES];
        for (int s = 0; s < SLICES; ++s) slice[s] = load8(v + 8 * s);
        for (int p = 0; p < P; ++p) {
          const float weight = scores[p * CHUNK + i];
          const f32x8 w = {weight, weight, weight, weight, weight, weight, weight, weight};
          for (int s = 0; s < SLICES; ++s) sums[p][s] = fma8(w, slice[s], sums[p][s]);
        }
      }
      for (int p = 0; p < P; ++p)
        for (int s = 0; s < SLICES; ++s) {
          const f32x8 sum = sums[p][s];  // (a copy: were the array's address taken, GCC would keep it in memory)
          std::memcpy(out[p] + 8 * (j0 + s), &sum, sizeof sum);
        }
    }
  }
}
#endif

// The same for any head size (tiny test models), one head and one lane at a time.
template <typename T>
void attend_heads_any(const float* const* q, const T* keys, const T* values, const int64_t* rows, int64_t n,
                      int64_t heads, int64_t dim, float scale, float* scores, float* const* out,
                      std::pair<float, float>* stats) {
  for (int64_t p = 0; p < heads; ++p) {
    float* sp = scores + p * CHUNK;
    for (int64_t i = 0; i < n; ++i) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += q[p][d] * scale * to_float(keys[rows[i] + d]);
      sp[i] = dot;
    }
    stats[p] = softmax_numerators(sp, n);
    std::fill(out[p], out[p] + dim, 0.f);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < dim; ++d) out[p][d] += sp[i] * to_float(values[rows[i] + d]);
  }
}

constexpr int MAX_PASS = 4;  // query heads attended together: their queries and outputs fit in registers

struct Shape {
  int64_t head_dim, kv_width, block_size, block_stride;
};

// Query heads that share a KV head, at most MAX_PASS (and at most 2 of size 128), attended together.
std::vector<std::vector<int64_t>> head_passes(const int64_t* kv_head, int64_t heads, int64_t head_dim) {
  const int64_t most = head_dim == 64 ? MAX_PASS : head_dim == 128 ? 2 : 1;
  std::vector<std::vector<int64_t>> passes;
  std::vector<int64_t> done(heads, 0);
  for (int64_t h = 0; h < heads; ++h) {
    if (done[h]) continue;
    passes.emplace_back();
    for (int64_t g = h; g < heads; ++g) {
      if (done[g] || kv_head[g] != kv_head[h]) continue;
      if (static_cast<int64_t>(passes.back().size()) == most) passes.emplace_back();
      passes.back().push_back(g);
      done[g] = 1;
    }
  }
  return passes;
}

template <int V, typename T>
void attend_pass(int64_t size, const float* const* q, const T* keys, const T* values, const int64_t* rows,
                 int64_t n, float scale, float* scores, float* const* out, std::pair<float, float>* stats) {
  switch (size) {
    case 1: return attend_heads<V, 1>(q, keys, values, rows, n, scale, scores, out, stats);
    case 2: return attend_heads<V, 2>(q, keys, values, rows, n, scale, scores, out, stats);
    case 3: return attend_heads<V, 3>(q, keys, values, rows, n, scale, scores, out, stats);
    default: return attend_heads<V, 4>(q, keys, values, rows, n, scale, scores, out, stats);
  }
}

// One chunk [first, last) of one sequence: acc [Hq, D] (unnormalised), row_max [Hq], row_sum [Hq].
template <typename T>
void attend_chunk(const float* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t first,
                  int64_t last, const std::vector<std::vector<int64_t>>& passes,
                  const int64_t* kv_head, float scale, const Shape& s, int64_t* rows, float* scores, float* acc,
                  float* row_max, float* row_sum) {
  const int64_t n = last - first, dim = s.head_dim;
  for (int64_t t = first; t < last;) {  // where each token's row lies, one division per block
    const int64_t offset = t % s.block_size, count = std::min(s.block_size - offset, last - t);
    const int64_t row = table[t / s.block_size] * s.block_stride + offset * s.kv_width;
    for (int64_t i = 0; i < count; ++i) rows[t - first + i] = row + i * s.kv_width;
    t += count;
  }
  for (const auto& pass : passes) {
    const T* keys = k_cache + kv_head[pass[0]] * dim;
    const T* values = v_cache + kv_head[pass[0]] * dim;
    const float* qs[MAX_PASS];
    float* outs[MAX_PASS];
    std::pair<float, float> stats[MAX_PASS];
    const int64_t size = static_cast<int64_t>(pass.size());
    for (int64_t p = 0; p < size; ++p) qs[p] = q + pass[p] * dim, outs[p] = acc + pass[p] * dim;
    for (int64_t i = 0; i < std::min(n, AHEAD); ++i)  // the rows the loops' own prefetches start past
      prefetch_row(keys + rows[i], dim * sizeof(T)), prefetch_row(values + rows[i], dim * sizeof(T));
    if (dim == 64)
      attend_pass<4>(size, qs, keys, values, rows, n, scale, scores, outs, stats);
    else if (dim == 128)
      attend_pass<8>(size, qs, keys, values, rows, n, scale, scores, outs, stats);
    else
      attend_heads_any(qs, keys, values, rows, n, size, dim, scale, scores, outs, stats);
    for (int64_t p = 0; p < size; ++p) row_max[pass[p]] = stats[p].first, row_sum[pass[p]] = stats[p].second;
  }
}

// q: `batch` rows of `heads` x head_dim, row b at qp + b * q_stride; out [batch, heads, head_dim]
template <typename T>
void run(const T* qp, int64_t q_stride, int64_t batch, int64_t heads, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& kv_heads,
         double scale, at::Tensor& out) {
  const int64_t max_blocks = tables.size(1);
  const Shape s{k_cache.size(3), k_cache.size(2) * k_cache.size(3), k_cache.size(1),
                k_cache.size(1) * k_cache.size(2) * k_cache.size(3)};
  const int32_t* len = lens.data_ptr<int32_t>();
  std::vector<int64_t> first_item(batch + 1, 0);  // the work items of sequence b: [first_item[b], first_item[b + 1])
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {  // every row read lies in the cache
    TORCH_CHECK(len[b] >= 1 && len[b] <= max_blocks * s.block_size, "context_lens[", b, "] = ", len[b],
                " must be in [1, ", max_blocks * s.block_size, "]");
    for (int64_t i = 0; i < (len[b] + s.block_size - 1) / s.block_size; ++i)
      TORCH_CHECK(tp[b * max_blocks + i] >= 0 && tp[b * max_blocks + i] < k_cache.size(0), "block_tables[", b, ", ",
                  i, "] = ", tp[b * max_blocks + i], " is not a block of the cache");
    first_item[b + 1] = first_item[b] + (len[b] + CHUNK - 1) / CHUNK;
  }
  const int64_t items = first_item[batch], HD = heads * s.head_dim;

  // every item writes its whole part of these (no zeroing needed)
  std::unique_ptr<float[]> acc(new float[items * HD]), row_max(new float[items * heads]),
      row_sum(new float[items * heads]);
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* hp = kv_heads.data_ptr<int64_t>();
  const auto passes = head_passes(hp, heads, s.head_dim);
  const int64_t widest = std::max_element(passes.begin(), passes.end(), [](const auto& a, const auto& b) {
                           return a.size() < b.size();
                         })->size();
  // a sequence's output from its chunks' partials, merged by log-sum-exp in chunk order (one chunk: divided by
  // its sum, the same bits as the merge gives it)
  const auto finish = [&](int64_t b, float* merged) {
    for (int64_t h = 0; h < heads; ++h) {
      float m = row_max[first_item[b] * heads + h];
      for (int64_t i = first_item[b] + 1; i < first_item[b + 1]; ++i) m = std::max(m, row_max[i * heads + h]);
      float total = 0.f;
      std::fill(merged, merged + s.head_dim, 0.f);
      for (int64_t i = first_item[b]; i < first_item[b + 1]; ++i) {
        const float w = std::exp(row_max[i * heads + h] - m);
        total += w * row_sum[i * heads + h];
        const float* ah = acc.get() + i * HD + h * s.head_dim;
        for (int64_t d = 0; d < s.head_dim; ++d) merged[d] += w * ah[d];
      }
      for (int64_t d = 0; d < s.head_dim; ++d) op[b * HD + h * s.head_dim + d] = static_cast<T>(merged[d] / total);
    }
  };

  const auto attend_items = [&](int64_t begin, int64_t end) {
    std::vector<float> scores(widest * CHUNK), qf(HD), merged(s.head_dim);
    std::vector<int64_t> rows(CHUNK);
    int64_t b = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1, had = -1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[b + 1]) ++b;
      if (b != had) {  // this sequence's query in float32
        for (int64_t i = 0; i < HD; ++i) qf[i] = to_float(qp[b * q_stride + i]);
        had = b;
      }
      const int64_t first = (item - first_item[b]) * CHUNK, last = std::min<int64_t>(first + CHUNK, len[b]);
      attend_chunk(qf.data(), kp, vp, tp + b * max_blocks, first, last, passes, hp, static_cast<float>(scale), s,
                   rows.data(), scores.data(), acc.get() + item * HD, row_max.get() + item * heads,
                   row_sum.get() + item * heads);
      if (first_item[b + 1] - first_item[b] == 1) finish(b, merged.data());  // one chunk: done here
    }
  };
  parallel_for(items, attend_items);  // short contexts too: their rows come from memory

  std::vector<float> merged(s.head_dim);  // sequences of several chunks, on this thread: little work
  for (int64_t b = 0; b < batch; ++b)
    if (first_item[b + 1] - first_item[b] > 1) finish(b, merged.data());
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& kv_heads, double scale) {
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    run<scalar_t>(q.data_ptr<scalar_t>(), q.size(1) * q.size(2), q.size(0), q.size(1), k_cache, v_cache, tables,
                  lens, kv_heads, scale, out);
  });
  return out;
}

// A decode-only step's attention from a layer's fused projection, in one call: each row of qkv [B, >= (Hq +
// 2 Hkv) D] holds a token's q, k and v heads; RoPE rotates q and k in place (as rope_ does), k and v are
// written to the caches at the token's slot, then the query attends as paged_decode does. -> [B, Hq * D]
at::Tensor decode_attention(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& tables,
                            const at::Tensor& lens, const at::Tensor& kv_heads, double scale, int64_t heads) {
  const int64_t batch = qkv.size(0), kv_heads_n = k_cache.size(2), dim = k_cache.size(3);
  const int64_t slots_n = k_cache.size(0) * k_cache.size(1), row = kv_heads_n * dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= (heads + 2 * kv_heads_n) * dim,
              "qkv must be [B, >= ", (heads + 2 * kv_heads_n) * dim, "] with rows of unit stride, got ", qkv.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type() &&
                  dim % 2 == 0,
              "the caches must be contiguous [blocks, block_size, kv_heads, D even] in qkv's dtype");
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->is_contiguous() && table->numel() == batch * dim && table->scalar_type() == qkv.scalar_type(),
                "cos and sin must be [", batch, ", ..., ", dim, "] in ", qkv.scalar_type());
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == batch && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slot_mapping must be [", batch, "] int64");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && tables.scalar_type() == at::kLong &&
                  tables.is_contiguous() && lens.dim() == 1 && lens.size(0) == batch &&
                  lens.scalar_type() == at::kInt && kv_heads.numel() == heads && kv_heads.scalar_type() == at::kLong,
              "block_tables [", batch, ", W] int64, context_lens [", batch, "] int32 and kv_head [", heads,
              "] int64 expected");
  const int64_t* kh = kv_heads.data_ptr<int64_t>();
  for (int64_t h = 0; h < heads; ++h)
    TORCH_CHECK(kh[h] >= 0 && kh[h] < kv_heads_n, "kv_head[", h, "] = ", kh[h], " is not in [0, ", kv_heads_n, ")");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < slots_n, "slot_mapping[", b, "] = ", sp[b], " is not a slot of the cache");
  at::Tensor out = at::empty({batch, heads, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "decode_attention", [&] {
    scalar_t *xp = qkv.data_ptr<scalar_t>(), *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    const scalar_t *cp = cos.data_ptr<scalar_t>(), *snp = sin.data_ptr<scalar_t>();
    for (int64_t b = 0; b < batch; ++b) {
      scalar_t* x = xp + b * qkv.stride(0);
      for (int64_t h = 0; h < heads + kv_heads_n; ++h) rotate(x + h * dim, cp + b * dim, snp + b * dim, dim / 2);
      std::memcpy(kc + sp[b] * row, x + heads * dim, row * sizeof(scalar_t));
      std::memcpy(vc + sp[b] * row, x + (heads + kv_heads_n) * dim, row * sizeof(scalar_t));
    }
    run<scalar_t>(xp, qkv.stride(0), batch, heads, k_cache, v_cache, tables, lens, kv_heads, scale, out);
  });
  return out.view({batch, heads * dim});
}

}  // namespace

namespace infermesh_cpu::direct {
at::Tensor decode_attention(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& tables,
                            const at::Tensor& lens, const at::Tensor& kv_heads, double scale, int64_t heads) {
  return ::decode_attention(qkv, cos, sin, k_cache, v_cache, slots, tables, lens, kv_heads, scale, heads);
}
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& kv_heads, double scale) {
  return ::paged_decode(q, k_cache, v_cache, tables, lens, kv_heads, scale);
}
}  // namespace infermesh_cpu::direct

TORCH_LIBRARY_FRAGMENT(infermesh_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "Tensor kv_head, float scale) -> Tensor", &paged_decode);
  m.def("decode_attention(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, Tensor kv_head, float scale, int heads) "
        "-> Tensor", &decode_attention);
}
