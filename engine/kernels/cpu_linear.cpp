// A linear layer for a few rows of activations on CPU (decode), bound by reading the weight.
//
// infermesh_cpu::linear(x [M, K], weight [N, K]) -> [M, N] = x @ weight.T, in x's dtype, for
// 1 <= M <= linear_rows(dtype): 64, but 8 in float32 (on the fma path MKL's GEMM is faster past ~16)
// (linear_path(dtype) names the path: amx, dot or fma; INFERMESH_CPU_BF16=dot|fma caps it); and
// infermesh_cpu::linear_int8(x [M, K], weight int8 [N, K], scale [N], batch_invariant=True) -> [M, N] =
// (x @ weight.T) * scale for 1 <= M <= linear_int8_rows(dtype) (engine/quantize.py): 64, but 16 with float32 x on
// the fma path.
//
// Every output is summed in one order whatever M and the thread count, so a row of x gets the same result
// bit for bit in any batch the kernel takes (linear_int8 not batch_invariant: in any batch of 2 rows or more).
// (Not the same as torch's GEMM, whose order is its own, nor the same from one path to another.)
//
// amx (Sapphire Rapids and later): tiles of 16 weight rows x 32 k (read straight from the weight) times
// 32 k x up to 16 rows of x (x rearranged in pairs, as TDPBF16PS takes it), summed into float32 tiles over
// ascending k; ~1.4x torch's `mv` at one row and 1.0-1.9x its GEMM at 4 to 64 (bench/linear.py). dot
// (AVX512-BF16 without AMX, e.g. AMD Zen 4): VDPBF16PS sums bf16 pairs of a weight row and a row of x into
// 16 float32 lanes, 4 weight rows x 4 rows of x at a time, the lanes then added 16 sums at once. fma, float32
// vector FMAs:
// with AVX-512 each intra-op thread streams a contiguous range of weight rows once for all M rows,
// prefetching 2 KiB ahead (two float32 accumulators over 32-weight steps, then halved; the last k % 32 one by
// one); with AVX2 only, blocks of weight rows times rows of x held in registers, shaped by M (below).

#include <torch/library.h>

#include "cpu_vec.h"

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#ifdef INFERMESH_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace infermesh_cpu;

constexpr int64_t FLOAT32_ROWS = 8;  // float32 (on the fma path: MKL's GEMM is faster past ~16 rows)
constexpr int64_t WIDE_ROWS = 64;  // the amx and dot paths: every decode step of the default max_num_seqs
constexpr int64_t AHEAD_BYTES = 2048;

inline f32x16 int8_to_float(const int8_t* p) {  // 16 of them
#ifdef INFERMESH_AVX512
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else  // GCC's vector conversions from int8 compile to scalar code (GCC 12): this at least vectorizes the loop
  f32x16 v;
  for (int j = 0; j < 16; ++j) v[j] = p[j];
  return v;
#endif
}

// A 32-weight step as two float32 vectors. bf16: a 64-byte load holds them, and as 16 32-bit lanes
// (lane << 16) are the even weights and (lane & 0xFFFF0000) the odd ones: no widening shuffles.
template <typename W>
inline void load_step(const W* w, f32x16& a, f32x16& b) {
  a = load16(w), b = load16(w + 16);
}
template <>
inline void load_step(const c10::BFloat16* w, f32x16& a, f32x16& b) {
  u32x16 pairs;
  std::memcpy(&pairs, w, sizeof pairs);
  a = (f32x16)(pairs << 16), b = (f32x16)(pairs & 0xFFFF0000u);
}
template <>
inline void load_step(const int8_t* w, f32x16& a, f32x16& b) {
  a = int8_to_float(w), b = int8_to_float(w + 16);
}

// x [k] as float32 in the order load_step gives a step's weights of type W (bf16: each 32's even, then odd
// positions; others as they are).
template <typename W, typename T>
void arrange_x(const T* x, float* out, int64_t k) {
  int64_t c = 0;
  if constexpr (std::is_same_v<W, c10::BFloat16>)
    for (; c + 32 <= k; c += 32)
      for (int64_t i = 0; i < 16; ++i)
        out[c + i] = to_float(x[c + 2 * i]), out[c + 16 + i] = to_float(x[c + 2 * i + 1]);
  for (; c < k; ++c) out[c] = to_float(x[c]);
}

// y[g * n] = scale * <w, x[g]> for the G rows of x (arranged, row stride k): one pass over the weight row.
#ifdef INFERMESH_AVX512
template <int G, typename W, typename Y>
void dot_rows(const W* w, const float* x, int64_t k, float scale, Y* y, int64_t n) {
  f32x16 even[G] = {}, odd[G] = {};
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    for (int64_t b = 0; b < 32 * static_cast<int64_t>(sizeof(W)); b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(w + c) + AHEAD_BYTES + b);
    f32x16 a, b;
    load_step(w + c, a, b);
    for (int g = 0; g < G; ++g) {
      even[g] += a * load16(x + g * k + c);
      odd[g] += b * load16(x + g * k + c + 16);
    }
  }
  for (int g = 0; g < G; ++g) {
    float sum = sum16(even[g] + odd[g]);
    for (int64_t t = c; t < k; ++t) sum += to_float(w[t]) * x[g * k + t];
    y[g * n] = static_cast<Y>(sum * scale);
  }
}

// rows of x summed in one pass over a weight row, in registers
constexpr int64_t GROUP = 8;
// y [m, n] from the m rows of x (arranged) and the weight rows (scale[r] each, or none): each intra-op
// thread streams its range of weight rows, once per GROUP rows of x (past the first group from cache).
template <typename W, typename Y>
void run(const W* w, int64_t stride, const float* scale, const float* x, int64_t m, int64_t k, Y* y, int64_t n) {
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < m; g += GROUP) {
        const W* wr = w + r * stride;
        const float* xg = x + g * k;
        const float s = scale ? scale[r] : 1.0f;
        Y* yg = y + g * n + r;
        switch (std::min(GROUP, m - g)) {
          case 1: dot_rows<1>(wr, xg, k, s, yg, n); break;
          case 2: dot_rows<2>(wr, xg, k, s, yg, n); break;
          case 3: dot_rows<3>(wr, xg, k, s, yg, n); break;
          case 4: dot_rows<4>(wr, xg, k, s, yg, n); break;
          case 5: dot_rows<5>(wr, xg, k, s, yg, n); break;
          case 6: dot_rows<6>(wr, xg, k, s, yg, n); break;
          case 7: dot_rows<7>(wr, xg, k, s, yg, n); break;
          default: dot_rows<8>(wr, xg, k, s, yg, n);
        }
      }
  });
}
#else
// Without AVX-512 (AVX2 and FMA: 16 registers of 8 floats), a register-blocked kernel. Each output is one
// 8-float accumulator over the arranged k, 8 at a time in ascending order, its lanes then added (sum8), then
// the last k % 32 one by one: one order whatever the blocking, so the blocking follows M. A block is W weight
// rows times up to G rows of x, W * G accumulators in registers; each step's weights are converted once per
// block and used for every row of x in it, so past a few rows of x the FMAs bound the kernel, not the loads
// and conversions (1.6-1.8x the loop before it at 16-64 rows).
// The first group of x rows streams the weights from memory, prefetching ahead; the others read them from
// cache. FMAs written out (fma8, std::fma): left to GCC, some instantiations multiplied and added apart.

// Quarter q (lanes 8q..8q+7) of a 32-weight step as float32 in the arranged order (arrange_x): bf16 steps
// hold the even weights of k 0-15 and 16-31, then the odd ones.
template <typename W>
inline f32x8 quarter(const W* w, int q) {
  return load8(w + 8 * q);
}
template <>
inline f32x8 quarter(const c10::BFloat16* w, int q) {
  u32x8 pairs;  // k pairs 0-7 (q even) or 8-15 (q odd) of the step, a bf16 weight in each half
  std::memcpy(&pairs, w + 16 * (q % 2), sizeof pairs);
  return (f32x8)(q < 2 ? pairs << 16 : pairs & 0xFFFF0000u);
}
#ifdef INFERMESH_AVX2
template <>
inline f32x8 quarter(const int8_t* w, int q) {
  const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * q));
  return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
}
#endif

// y[g * n + i] = scale[i] * <weight row i, x[g]> for W weight rows from w (`rows` of them real: the others
// repeat the last, summed and dropped) and G rows of x (arranged, row stride k).
template <int W, int G, typename Wt, typename Y>
void block_rows(const Wt* w, int64_t stride, int64_t rows, const float* x, int64_t k, const float* scale, Y* y,
                int64_t n, bool prefetch) {
  static_assert(W * G + W + 1 <= 16, "the accumulators, a step's weights and a vector of x fit 16 registers");
  const Wt* row[W];
  for (int i = 0; i < W; ++i) row[i] = w + std::min<int64_t>(i, rows - 1) * stride;
  // one row: further along its stream; more: the next block's rows in step (each its own stream)
  const int64_t ahead = W == 1 ? AHEAD_BYTES : W * stride * static_cast<int64_t>(sizeof(Wt));
  f32x8 acc[W][G];
  for (auto& sums : acc)  // (not `= {}`: GCC zeroed that through a call to memset, 3 % of the kernel at k = 128)
    for (f32x8& sum : sums) sum = f32x8{};
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    if (prefetch)
      for (int i = 0; i < W; ++i)
        for (int64_t b = 0; b < 32 * static_cast<int64_t>(sizeof(Wt)); b += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(row[i] + c) + ahead + b);
    for (int q = 0; q < 4; ++q) {
      f32x8 s[W];
      for (int i = 0; i < W; ++i) s[i] = quarter(row[i] + c, q);
      for (int g = 0; g < G; ++g) {
        f32x8 xs = load8(x + g * k + c + 8 * q);
#if defined(__x86_64__)
        asm("" : "+x"(xs));  // loaded once into a register: GCC would fold a load into each of the W FMAs
#endif
        for (int i = 0; i < W; ++i) acc[i][g] = fma8(s[i], xs, acc[i][g]);
      }
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int g = 0; g < G; ++g) {
      float sum = sum8(acc[i][g]);
      for (int64_t t = c; t < k; ++t) sum = std::fma(to_float(row[i][t]), x[g * k + t], sum);
      y[g * n + i] = static_cast<Y>(sum * (scale ? scale[i] : 1.0f));
    }
}

// y [m, n] as run below, in blocks of W weight rows times up to G rows of x.
template <int W, int G, typename Wt, typename Y>
void run_blocks(const Wt* w, int64_t stride, const float* scale, const float* x, int64_t m, int64_t k, Y* y,
                int64_t n) {
  parallel_for((n + W - 1) / W, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r = b * W, rows = std::min<int64_t>(W, n - r);
      for (int64_t g = 0; g < m; g += G) {
        const Wt* wr = w + r * stride;
        const float* xg = x + g * k;
        const float* s = scale ? scale + r : nullptr;
        Y* yg = y + g * n + r;
        switch (std::min<int64_t>(G, m - g)) {
          case 1: block_rows<W, 1>(wr, stride, rows, xg, k, s, yg, n, g == 0); break;
          case 2: block_rows<W, std::min(G, 2)>(wr, stride, rows, xg, k, s, yg, n, g == 0); break;
          case 3: block_rows<W, std::min(G, 3)>(wr, stride, rows, xg, k, s, yg, n, g == 0); break;
          default: block_rows<W, G>(wr, stride, rows, xg, k, s, yg, n, g == 0);
        }
      }
    }
  });
}

// y [m, n] from the m rows of x (arranged) and the weight rows (scale[r] each, or none): each intra-op thread takes
// its range of weight rows a block at a time. The shapes, measured on an AVX2 Zen 3: at one row memory bounds bf16,
// and one weight row at a time reads it best (more streams at once read it 5-15 % slower); int8 steps are half the
// bytes, so there the FMAs' latency bounds a row's one chain of sums and 4 weight rows side by side go faster; past a
// few rows, blocks that convert each weight vector once for more rows of x.
template <typename W, typename Y>
void run(const W* w, int64_t stride, const float* scale, const float* x, int64_t m, int64_t k, Y* y, int64_t n) {
  if (m <= 3 && std::is_same_v<W, int8_t>) return run_blocks<4, 2>(w, stride, scale, x, m, k, y, n);
  if (m == 1) return run_blocks<1, 1>(w, stride, scale, x, m, k, y, n);
  if (m <= 3) return run_blocks<2, 3>(w, stride, scale, x, m, k, y, n);
  if (m < 16) return run_blocks<2, 4>(w, stride, scale, x, m, k, y, n);
  run_blocks<3, 3>(w, stride, scale, x, m, k, y, n);
}
#endif

// ---- bf16 on AMX tiles ----

using bf16 = c10::BFloat16;

#ifdef INFERMESH_AMX

// Whether Linux gave the process the tiles' 8 KiB of state (it asks, once).
bool amx_granted() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

struct alignas(64) TileConfig {  // palette 1: each tile's rows and bytes per row, loaded per thread
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t row_bytes[16] = {};
  uint8_t rows[16] = {};
};

// Where an A tile (16 weight rows x 32 k from k0) loads from, and its row stride in bytes: the weight itself,
// or a zero-padded copy in `pad` where the weight ends (fewer than 16 rows, or fewer than 32 k).
inline const bf16* weight_tile(const bf16* w, int64_t stride, int64_t rows, int64_t k0, int64_t k, bf16* pad,
                               int64_t& row_bytes) {
  if (rows == 16 && k0 + 32 <= k) return row_bytes = stride * 2, w + k0;
  std::memset(pad, 0, 16 * 32 * sizeof(bf16));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(pad + r * 32, w + r * stride + k0, std::min<int64_t>(32, k - k0) * sizeof(bf16));
  return row_bytes = 64, pad;
}

// Sums for WB blocks of 16 weight rows times XB tiles of x, over all k in 32-k steps, into `sums`
// ([WB * 2 + XB][16 weight rows][16 floats]). Tiles: C 0-3 ([weight block][x tile]), A 4-5, B 6-7. Each step
// also prefetches `ahead_lines` cache lines from `ahead` on into L2 (none where `ahead` is null).
template <int WB, int XB>
void tile_sums(const bf16* w, int64_t stride, const int64_t* rows, int64_t k, const bf16* xs, int64_t x_row_bytes,
               int64_t x_tile, float* sums, bf16* pad, const char* ahead, int64_t ahead_lines) {
  _tile_zero(0);
  if (XB == 2) _tile_zero(1);
  if (WB == 2) _tile_zero(2);
  if (WB == 2 && XB == 2) _tile_zero(3);
  int64_t row_bytes;
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    const bf16* x_step = xs + k0 / 2 * (x_row_bytes / sizeof(bf16));  // 16 k pairs of this step
    _tile_loadd(6, x_step, x_row_bytes);
    if (XB == 2) _tile_loadd(7, x_step + x_tile, x_row_bytes);
    _tile_loadd(4, weight_tile(w, stride, rows[0], k0, k, pad, row_bytes), row_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if (XB == 2) _tile_dpbf16ps(1, 4, 7);
    if (ahead)
      for (int64_t i = 0; i < ahead_lines; ++i, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
    if (WB == 2) {
      _tile_loadd(5, weight_tile(w + 16 * stride, stride, rows[1], k0, k, pad + 512, row_bytes), row_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if (XB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 64);
  if (XB == 2) _tile_stored(1, sums + 256, 64);
  if (WB == 2) _tile_stored(2, sums + 512, 64);
  if (WB == 2 && XB == 2) _tile_stored(3, sums + 768, 64);
}

// One row of x and whole tile pairs (n % 32 == 0, k % 32 == 0): the tiles below in the same order, with x read in
// place (one row is already the B tile's [k pair][row][2]) and nothing padded or rearranged: ~10 % faster at
// one row.
at::Tensor linear_amx_row(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1), stride = weight.stride(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({1, n}, x.options());
  const bf16 *w = weight.data_ptr<bf16>(), *xs = xc.data_ptr<bf16>();
  bf16* y = out.data_ptr<bf16>();
  parallel_for(n / 32, [&](int64_t begin, int64_t end) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.row_bytes[t] = t == 4 || t == 5 ? 64 : 4;
    _tile_loadconfig(&config);
    alignas(64) float sums[32];
    for (int64_t pair = begin; pair < end; ++pair) {
      const bf16* wp = w + 32 * pair * stride;
      _tile_zero(0);
      _tile_zero(2);
      for (int64_t k0 = 0; k0 < k; k0 += 32) {
        _tile_loadd(6, xs + k0, 4);
        _tile_loadd(4, wp + k0, stride * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, wp + 16 * stride + k0, stride * 2);
        _tile_dpbf16ps(2, 5, 6);
      }
      _tile_stored(0, sums, 4);
      _tile_stored(2, sums + 16, 4);
      store(y + 32 * pair, load16(sums));
      store(y + 32 * pair + 16, load16(sums + 16));
    }
    _tile_release();
  });
  return out;
}

// 32 weight rows from `w` (`rows` of them real) as bf16 in `block` [32][padded_k]: int8 converted exactly
// (|w| <= 127: 7 bits), zeros past the last row and past k.
void convert_rows(const int8_t* w, int64_t stride, int64_t rows, int64_t k, int64_t padded_k, bf16* block) {
  for (int64_t r = 0; r < 32; ++r) {
    bf16* out = block + r * padded_k;
    if (r >= rows) {
      std::memset(out, 0, padded_k * sizeof(bf16));
      continue;
    }
    const int8_t* row = w + r * stride;
    int64_t c = 0;
    for (; c + 32 <= k; c += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(row + c + 32 * stride), _MM_HINT_T1);  // the next pass's row
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
          row + c))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
          row + c + 16))));
      _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    for (; c < padded_k; ++c) out[c] = c < k ? static_cast<bf16>(static_cast<float>(row[c])) : bf16(0.f);
  }
}

// Column c of a float32 C tile stored with 64-byte rows ([16 weight rows][x rows]): x row c's 16 sums, in one
// gather (element by element, 6-8 % more time for a 32-row layer's projections from cache).
inline f32x16 tile_column(const float* tile, int64_t c) {
  const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  return (f32x16)_mm512_i32gather_ps(rows, tile + c, 4);
}

// W: bf16 weights (read in place), or int8 ones with one scale a row (`scale`), each pass's 32 rows converted
// to bf16 first (convert_rows) and then summed as bf16 weights are, times the rows' scales.
template <typename W>
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& weight, const float* scale = nullptr) {
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1), stride = weight.stride(0);
  constexpr bool int8 = std::is_same_v<W, int8_t>;
  if (!int8 && m == 1 && n % 32 == 0 && k % 32 == 0) return linear_amx_row(x, weight);
  const int64_t padded_k = (k + 31) / 32 * 32;
  const int64_t width = std::min<int64_t>(m, 16), x_tiles = (m + width - 1) / width;  // x rows per tile, tiles
  const int64_t x_tile = padded_k * width;                                             // bf16 per x tile
  // x as TDPBF16PS takes it: [x tile][k pair][row in tile][2], zeros past k (the weight's zeros there must not
  // meet a NaN). The last tile's rows past m are left as they are: they only reach sums that are not read.
  // (Zeroing the whole buffer cost ~3.5 us a call, ~0.4 ms of a 40-row step's 120 projections.)
  at::Tensor xs_t = at::empty({x_tiles * x_tile}, x.options());
  bf16* xs = xs_t.data_ptr<bf16>();
  if (k % 32)
    for (int64_t t = 0, pad_from = k / 2 * width * 2; t < x_tiles; ++t)  // from the pair k / 2 on
      std::memset(xs + t * x_tile + pad_from, 0, (x_tile - pad_from) * sizeof(bf16));
  const at::Tensor xc = x.contiguous();
  int64_t r = 0;
  if (k % 2 == 0) {  // whole tiles: each k pair of a tile's rows in one gather (one 4-byte copy a row: 12-14 %
                     // more time for a layer's projections from cache at 32-40 rows)
    const __mmask16 lanes = static_cast<__mmask16>((1u << width) - 1);
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(k / 2)));  // in pairs
    for (; r + width <= m; r += width) {
      const int* src = reinterpret_cast<const int*>(xc.data_ptr<bf16>() + r * k);
      bf16* dst = xs + r / width * x_tile;
      for (int64_t p = 0; p < k / 2; ++p)
        _mm512_mask_storeu_epi32(dst + 2 * width * p, lanes,
                                 _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, rows, src + p, 4));
    }
  }
  for (; r < m; ++r) {  // the last tile's rows where it is not whole, and odd k
    const bf16* src = xc.data_ptr<bf16>() + r * k;
    bf16* dst = xs + r / width * x_tile + r % width * 2;
    for (int64_t c = 0; c + 1 < k; c += 2) std::memcpy(dst + c * width, src + c, 2 * sizeof(bf16));
    if (k % 2) dst[(k - 1) * width] = src[k - 1];
  }
  at::Tensor out = at::empty({m, n}, x.options());
  const W* w = weight.data_ptr<W>();
  bf16* y = out.data_ptr<bf16>();
  const int64_t blocks = (n + 15) / 16;
  // a pair of weight blocks (32 rows x stride x 2 bytes) is `stride` cache lines: a share of them each 32-k step
  const int64_t ahead_lines = (stride + (k + 31) / 32 - 1) / ((k + 31) / 32);
  using TileSums = decltype(&tile_sums<1, 1>);  // by [weight blocks - 1][x tiles - 1]
  static constexpr TileSums tile_sums_of[2][2] = {{tile_sums<1, 1>, tile_sums<1, 2>},
                                                  {tile_sums<2, 1>, tile_sums<2, 2>}};
  parallel_for((blocks + 1) / 2, [&](int64_t begin, int64_t end) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.row_bytes[t] = t == 4 || t == 5 ? 64 : width * 4;
    _tile_loadconfig(&config);
    alignas(64) float sums[1024];
    alignas(64) bf16 pad[1024];
    // int8: this pass's weight rows as bf16 (64-byte aligned, as the tile rows read best)
    const at::Tensor converted = at::empty({int8 ? 32 * padded_k : 0}, x.options());
    const int64_t whole[2] = {16, 16};
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = 2 * pair, wb = b + 1 < blocks ? 2 : 1;
      const int64_t rows[2] = {std::min<int64_t>(16, n - 16 * b), std::min<int64_t>(16, n - 16 * b - 16)};
      const bf16* wp;
      int64_t w_stride, w_k;  // the tiles' weight rows, their stride and length
      if constexpr (int8) {
        bf16* rows_bf16 = converted.data_ptr<bf16>();
        convert_rows(w + 16 * b * stride, stride, std::min<int64_t>(32, n - 16 * b), k, padded_k, rows_bf16);
        wp = rows_bf16, w_stride = w_k = padded_k;
      } else {
        wp = w + 16 * b * stride, w_stride = stride, w_k = k;
      }
      const int64_t* tile_rows = int8 ? whole : rows;  // (the converted rows are zero-padded to whole tiles)
      // bf16: the thread's next pair of weight blocks into L2 while the first x tiles are summed with this one (the
      // tiles' loads otherwise wait for memory: 4-32 rows 5-20 % faster); int8's conversion
      // prefetches its own
      const char* next = !int8 && pair + 1 < end ? reinterpret_cast<const char*>(w + 32 * (pair + 1) * stride)
                                                 : nullptr;
      for (int64_t t = 0; t < x_tiles; t += 2) {
        const int64_t xb = t + 1 < x_tiles ? 2 : 1;
        const bf16* xt = xs + t * x_tile;
        tile_sums_of[wb - 1][xb - 1](wp, w_stride, tile_rows, w_k, xt, width * 4, x_tile, sums, pad,
                                     t == 0 ? next : nullptr, ahead_lines);
        for (int64_t i = 0; i < wb; ++i)
          for (int64_t j = 0; j < xb; ++j) {
            const float* s = sums + (2 * i + j) * 256;  // [weight row][x row], rows 64 bytes apart
            const int64_t first = (t + j) * width;
            for (int64_t r = first; r < std::min(m, first + width); ++r) {
              bf16* y_row = y + r * n + 16 * (b + i);
              f32x16 v = tile_column(s, r - first);
              if constexpr (int8)  // each weight row's sum times its scale, then rounded once
                for (int64_t l = 0; l < rows[i]; ++l) v[l] *= scale[16 * (b + i) + l];
              if (rows[i] == 16) store(y_row, v);
              else for (int64_t l = 0; l < rows[i]; ++l) y_row[l] = static_cast<bf16>(v[l]);
            }
          }
      }
    }
    _tile_release();
  });
  return out;
}
#endif

// ---- bf16 on AVX512-BF16 dot products (VDPBF16PS), where there is no AMX ----

// (AVX512-BW: the masked 16-bit loads of a step's tail)
#ifdef INFERMESH_BF16_DOT
constexpr int DOT_W = 4, DOT_X = 4;  // weight rows x rows of x summed together, in 16 registers
constexpr int64_t DOT_READ_BOUND_ROWS = 3;  // up to this many rows of x, weight rows are read one after another

// y[r * n + g] for DOT_W weight rows (G of them real) and R rows of x (row stride k): each (weight row, x row)
// sums 16 float32 lanes, lane j taking the pairs at k = 32 c + 2 j over steps c in order (VDPBF16PS), the
// last step zero-padded; then sum16. Nothing depends on G, R, the neighbours or on whether the weight rows
// are read one after another (`Interleaved` false: one stream from memory, the few-row case, bound by
// reading) or side by side (true: 16 sums per step, the many-row case, bound by the dot products).
// 32 weights from p as bf16 pairs (zeros where `mask` is off); int8 converted exactly (|w| <= 127: 7 bits)
inline __m512bh load_pairs(const bf16* p, __mmask32 mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); }
inline __m512bh load_pairs(const int8_t* p, __mmask32 mask) {
  const __m256i bytes = _mm256_maskz_loadu_epi8(mask, p);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

template <int R, bool Interleaved>
void dot_block(const bf16* w, int64_t stride, int64_t G, const bf16* x, int64_t k, bf16* y, int64_t n,
               bool prefetch, const float* scale) {
  const bf16* rows[DOT_W];
  for (int g = 0; g < DOT_W; ++g) rows[g] = w + std::min<int64_t>(g, G - 1) * stride;  // past G: a repeat, unused
  // named, not an array: GCC keeps an array of sums in memory (the loads may alias it), not in registers
  const __m512 z = _mm512_setzero_ps();
  __m512 s00 = z, s01 = z, s02 = z, s03 = z, s10 = z, s11 = z, s12 = z, s13 = z,  // s<weight row><x row>
      s20 = z, s21 = z, s22 = z, s23 = z, s30 = z, s31 = z, s32 = z, s33 = z;
  // what a prefetching block fetches: side by side, the next DOT_W weight rows in step with these (one block's
  // dot products ahead, asked for by every group of x rows: asked once, weights from memory took 10-37 % longer
  // than from cache); one after another, further along the stream
  const int64_t ahead = Interleaved ? DOT_W * stride * static_cast<int64_t>(sizeof(bf16)) : AHEAD_BYTES;
  // one weight row's 32-k step from c (zeros where `mask` is off) into its sums with the R rows of x
  const auto step = [&](const bf16* row, int64_t c, __mmask32 mask, __m512& a0, __m512& a1, __m512& a2, __m512& a3)
      __attribute__((always_inline)) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(row + c) + ahead, _MM_HINT_T1);
    const __m512bh ws = load_pairs(row + c, mask);
    a0 = _mm512_dpbf16_ps(a0, ws, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + c));
    if constexpr (R > 1) a1 = _mm512_dpbf16_ps(a1, ws, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k + c));
    if constexpr (R > 2) a2 = _mm512_dpbf16_ps(a2, ws, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + 2 * k + c));
    if constexpr (R > 3) a3 = _mm512_dpbf16_ps(a3, ws, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + 3 * k + c));
  };
  const auto over_k = [&](const auto& each) __attribute__((always_inline)) {
    int64_t c = 0;
    for (; c + 32 <= k; c += 32) each(c, ~__mmask32{0});
    if (c < k) each(c, (__mmask32{1} << (k - c)) - 1);
  };
  if constexpr (Interleaved) {
    over_k([&](int64_t c, __mmask32 mask) __attribute__((always_inline)) {
      step(rows[0], c, mask, s00, s01, s02, s03), step(rows[1], c, mask, s10, s11, s12, s13);
      step(rows[2], c, mask, s20, s21, s22, s23), step(rows[3], c, mask, s30, s31, s32, s33);
    });
  } else {  // a weight row's every step, then the next row's
    const auto row_sums = [&](const bf16* row, __m512& a0, __m512& a1, __m512& a2, __m512& a3)
        __attribute__((always_inline)) {
      over_k([&](int64_t c, __mmask32 mask) __attribute__((always_inline)) { step(row, c, mask, a0, a1, a2, a3); });
    };
    row_sums(rows[0], s00, s01, s02, s03);
    if (G > 1) row_sums(rows[1], s10, s11, s12, s13);
    if (G > 2) row_sums(rows[2], s20, s21, s22, s23);
    if (G > 3) row_sums(rows[3], s30, s31, s32, s33);
  }
  // each sum's 16 lanes added as sum16 adds them, 16 sums at once: lane 4 r + g is s<g><r>
  f32x16 total = (f32x16)sum16x16({s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33});
  if (scale)  // int8 weights: each weight row's sums times its scale, then rounded once
    for (int j = 0; j < 16; ++j) total[j] *= scale[std::min<int64_t>(j % DOT_W, G - 1)];
  alignas(64) bf16 out[16];
  store(out, total);
  for (int r = 0; r < R; ++r) std::memcpy(y + r * n, out + 4 * r, G * sizeof(bf16));
}

// y[0, G) for DOT_W * DOT_X weight rows (G of them real) and one row of x: each row's sums as dot_block gives
// them (one chain of steps, then sum16x16), 16 chains side by side. For int8 weights and few rows of x, which
// a few chains leave waiting on VDPBF16PS's latency (int8 steps are half as many bytes as bf16 ones).
template <typename W>
void dot_block16(const W* w, int64_t stride, int64_t G, const bf16* x, int64_t k, bf16* y, const float* scale) {
  const W* rows[16];
  for (int g = 0; g < 16; ++g) rows[g] = w + std::min<int64_t>(g, G - 1) * stride;  // past G: a repeat, unused
  __m512 sums[16];
  for (int g = 0; g < 16; ++g) sums[g] = _mm512_setzero_ps();
  const auto step = [&](int64_t c, __mmask32 mask) __attribute__((always_inline)) {
    const __m512bh xs = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + c);
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[g] + c) + 16 * stride * sizeof(W), _MM_HINT_T1);
      sums[g] = _mm512_dpbf16_ps(sums[g], load_pairs(rows[g] + c, mask), xs);
    }
  };
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) step(c, ~__mmask32{0});
  if (c < k) step(c, (__mmask32{1} << (k - c)) - 1);
  // lane 4 c + j of sum16x16 sums its input 4 j + c: row 4 c + j goes there
  f32x16 total = (f32x16)sum16x16({sums[0], sums[4], sums[8], sums[12], sums[1], sums[5], sums[9], sums[13], sums[2],
                                   sums[6], sums[10], sums[14], sums[3], sums[7], sums[11], sums[15]});
  if (scale)
    for (int j = 0; j < 16; ++j) total[j] *= scale[std::min<int64_t>(j, G - 1)];
  alignas(64) bf16 out[16];
  store(out, total);
  std::memcpy(y, out, G * sizeof(bf16));
}

// `streamed`: the weight rows come from memory (prefetched ahead), not from a converted copy in cache.
template <bool Interleaved>
void dot_rows_of(const bf16* w, int64_t stride, int64_t G, const bf16* x, int64_t m, int64_t k, bf16* y, int64_t n,
                 bool streamed = true, const float* scale = nullptr) {
  for (int64_t r = 0; r < m; r += DOT_X) {
    const bf16* xr = x + r * k;
    bf16* yr = y + r * n;
    // one after another, the first rows of x stream the weights
    const bool prefetch = streamed && (Interleaved || r == 0);
    switch (std::min<int64_t>(DOT_X, m - r)) {
      case 1: dot_block<1, Interleaved>(w, stride, G, xr, k, yr, n, prefetch, scale); break;
      case 2: dot_block<2, Interleaved>(w, stride, G, xr, k, yr, n, prefetch, scale); break;
      case 3: dot_block<3, Interleaved>(w, stride, G, xr, k, yr, n, prefetch, scale); break;
      default: dot_block<4, Interleaved>(w, stride, G, xr, k, yr, n, prefetch, scale);
    }
  }
}

at::Tensor linear_dot(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1), stride = weight.stride(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  const bf16 *w = weight.data_ptr<bf16>(), *xs = xc.data_ptr<bf16>();
  bf16* y = out.data_ptr<bf16>();
  const bool interleaved = m > DOT_READ_BOUND_ROWS;
  parallel_for((n + DOT_W - 1) / DOT_W, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * DOT_W, G = std::min<int64_t>(DOT_W, n - first);
      if (interleaved) dot_rows_of<true>(w + first * stride, stride, G, xs, m, k, y + first, n);
      else dot_rows_of<false>(w + first * stride, stride, G, xs, m, k, y + first, n);
    }
  });
  return out;
}

// int8 weights on the dot path. Few rows of x: each weight row's 32-weight steps converted in registers as
// they stream, 16 weight rows side by side (dot_block16). More: each block of DOT_W weight rows converted to
// bf16 once (in cache, prefetching the next block), then summed as bf16 weights are. The same sums either way,
// times the rows' scales.
at::Tensor linear_int8_dot(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1), stride = weight.stride(0);
  const at::Tensor xc = x.contiguous(), sf = scale.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  const int8_t* w = weight.data_ptr<int8_t>();
  const bf16* xs = xc.data_ptr<bf16>();
  const float* sp = sf.data_ptr<float>();
  bf16* y = out.data_ptr<bf16>();
  if (m <= DOT_READ_BOUND_ROWS) {
    parallel_for((n + 15) / 16, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t first = b * 16, G = std::min<int64_t>(16, n - first);
        for (int64_t r = 0; r < m; ++r)
          dot_block16(w + first * stride, stride, G, xs + r * k, k, y + r * n + first, sp + first);
      }
    });
    return out;
  }
  parallel_for((n + DOT_W - 1) / DOT_W, [&](int64_t begin, int64_t end) {
    std::vector<bf16> block(DOT_W * k);  // [DOT_W, k]
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * DOT_W, G = std::min<int64_t>(DOT_W, n - first);
      const int8_t* rows = w + first * stride;
      for (int64_t g = 0; g < G; ++g) {
        int64_t c = 0;
        for (; c + 32 <= k; c += 32) {
          _mm_prefetch(reinterpret_cast<const char*>(rows + g * stride + c + DOT_W * stride), _MM_HINT_T1);
          _mm512_storeu_si512(block.data() + g * k + c, (__m512i)load_pairs(rows + g * stride + c, ~__mmask32{0}));
        }
        for (; c < k; ++c) block[g * k + c] = static_cast<bf16>(static_cast<float>(rows[g * stride + c]));
      }
      dot_rows_of<true>(block.data(), k, G, xs, m, k, y + first, n, false, sp + first);
    }
  });
  return out;
}
#endif

Bf16Path linear_path_of(c10::ScalarType dtype) { return dtype == at::kBFloat16 ? bf16_path() : Bf16Path::fma; }

// The path `linear` takes in this dtype, by name.
std::string linear_path(c10::ScalarType dtype) {
  static const char* const names[] = {"fma", "dot", "amx"};  // in Bf16Path's order
  return names[static_cast<int>(linear_path_of(dtype))];
}

// How many rows `linear` takes in this dtype.
int64_t linear_rows(c10::ScalarType dtype) {  // (the path read first: a cap it does not know is refused here)
  return linear_path_of(dtype) == Bf16Path::fma && dtype == at::kFloat ? FLOAT32_ROWS : WIDE_ROWS;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1 && weight.stride(0) >= weight.size(1),
              "weight must be [N, K] with rows of unit stride, got ", weight.sizes(), " strides ", weight.strides());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1) && x.scalar_type() == weight.scalar_type(), "x must be [M, ",
              weight.size(1), "] in ", weight.scalar_type(), ", got ", x.sizes(), " in ", x.scalar_type());
  const int64_t rows = linear_rows(x.scalar_type());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= rows, "x must have 1 to ", rows, " rows in ", x.scalar_type(), ", got ",
              x.size(0));
#ifdef INFERMESH_AMX
  if (linear_path_of(x.scalar_type()) == Bf16Path::amx) return linear_amx<bf16>(x, weight);
#endif
#ifdef INFERMESH_BF16_DOT
  if (linear_path_of(x.scalar_type()) == Bf16Path::dot) return linear_dot(x, weight);
#endif
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear", [&] {
    const std::unique_ptr<float[]> xf(new float[m * k]);  // [M, K] in float32, arranged (every one written)
    const at::Tensor xc = x.contiguous();
    for (int64_t i = 0; i < m; ++i) arrange_x<scalar_t>(xc.data_ptr<scalar_t>() + i * k, xf.get() + i * k, k);
    run(weight.data_ptr<scalar_t>(), weight.stride(0), nullptr, xf.get(), m, k, out.data_ptr<scalar_t>(), n);
  });
  return out;
}


// ---- int8 weights (engine/quantize.py: one scale per weight row) ----

constexpr int64_t INT8_ROWS = 16;  // float32 x on the fma path: as many as torch's int8 kernel took

// Whether int8 weights take the dot path with x in this dtype: bf16 where the CPU has AVX512-BF16 (and bf16
// is not capped to fma); else the fma path.
bool int8_dot(c10::ScalarType dtype) {
#ifdef INFERMESH_BF16_DOT
  return dtype == at::kBFloat16 && bf16_path() != Bf16Path::fma;
#else
  return false;
#endif
}

// How many rows `linear_int8` takes in this dtype.
int64_t linear_int8_rows(c10::ScalarType dtype) {
  return int8_dot(dtype) || dtype != at::kFloat ? WIDE_ROWS : INT8_ROWS;
}

// infermesh_cpu::linear_int8(x [M, K], weight int8 [N, K], scale [N], batch_invariant) -> [M, N] =
// (x @ weight.T) * scale, in x's dtype, 1 <= M <= linear_int8_rows(dtype). dot (up to 64 rows): the weights
// converted to bf16 exactly and summed as bf16 weights are (linear_int8_dot). fma (up to 16): each thread
// streams its weight rows once (twice past 8 rows, the second time from cache), int8 converted to float32 in
// registers. Either way every output is summed in one order whatever M and the threads (then scaled once): a
// row gets the same bits in any batch the path takes. Not `batch_invariant`, on AMX: 2 rows and more on AMX
// tiles (each pass's weight rows converted to bf16, then linear_amx's tiles), ~2.9x the dot path at 32 rows
// but ~30 % slower at one, which stays on the dot path; so a
// row's bits depend on whether it was alone.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, bool batch_invariant) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.stride(1) == 1 &&
                  weight.stride(0) >= weight.size(1),
              "weight must be int8 [N, K] with rows of unit stride, got ", weight.scalar_type(), " ", weight.sizes(),
              " strides ", weight.strides());
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == weight.size(0), "scale must be [", weight.size(0), "], got ",
              scale.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1), "x must be [M, ", weight.size(1), "], got ", x.sizes());
  const int64_t rows = linear_int8_rows(x.scalar_type());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= rows, "x must have 1 to ", rows, " rows in ", x.scalar_type(), ", got ",
              x.size(0));
#ifdef INFERMESH_AMX
  if (!batch_invariant && x.size(0) > 1 && linear_path_of(x.scalar_type()) == Bf16Path::amx) {
    const at::Tensor sf = scale.to(at::kFloat).contiguous();
    return linear_amx<int8_t>(x, weight, sf.data_ptr<float>());
  }
#endif
#ifdef INFERMESH_BF16_DOT
  if (int8_dot(x.scalar_type())) return linear_int8_dot(x, weight, scale);
#endif
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  const at::Tensor xf = x.to(at::kFloat).contiguous(), sf = scale.to(at::kFloat).contiguous();  // [M, K], [N]
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_int8", [&] {
    run(weight.data_ptr<int8_t>(), weight.stride(0), sf.data_ptr<float>(), xf.data_ptr<float>(), m, k,
        out.data_ptr<scalar_t>(), n);
  });
  return out;
}

}  // namespace

// ---- which path bf16 takes (cpu_vec.h) ----

namespace infermesh_cpu {

// (INFERMESH_CPU_BF16 = amx, dot or fma: an operator's switch, and how the tests reach every path a CPU has.)
Bf16Path bf16_path() {
  static const Bf16Path path = [] {
    const char* setting = std::getenv("INFERMESH_CPU_BF16");
    const std::string cap = setting && *setting ? setting : "amx";
    TORCH_CHECK(cap == "amx" || cap == "dot" || cap == "fma", "INFERMESH_CPU_BF16 must be amx, dot or fma, got '", cap,
                "'");
#ifdef INFERMESH_AMX
    if (cap == "amx" && amx_granted()) return Bf16Path::amx;
#endif
#ifdef INFERMESH_BF16_DOT
    if (cap != "fma") return Bf16Path::dot;
#endif
    return Bf16Path::fma;
  }();
  return path;
}

}  // namespace infermesh_cpu

namespace infermesh_cpu::direct {
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) { return ::linear(x, weight); }
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, bool batch_invariant) {
  return ::linear_int8(x, weight, scale, batch_invariant);
}
}  // namespace infermesh_cpu::direct

TORCH_LIBRARY_FRAGMENT(infermesh_cpu, m) {
  m.def("linear(Tensor x, Tensor weight) -> Tensor", &linear);
  m.def("linear_rows(ScalarType dtype) -> int", &linear_rows);
  m.def("linear_path(ScalarType dtype) -> str", &linear_path);
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scale, bool batch_invariant=True) -> Tensor", &linear_int8);
  m.def("linear_int8_rows(ScalarType dtype) -> int", &linear_int8_rows);
}
