// A linear layer for a few rows of activations on CPU (decode at small batch), bound by reading the weight.
//
// infermesh_cpu::linear(x [M, K], weight [N, K]) -> [M, N] = x @ weight.T, 1 <= M <= MAX_ROWS, in x's dtype
//
// Each intra-op thread of the caller streams a contiguous range of weight rows once for all M rows of x,
// prefetching 2 KiB ahead: the hardware prefetcher alone kept torch's `mv` and `mm` at ~60 % of a plain
// read of the same bytes (bench/RESULTS.md, "few-row linear"). Every output is summed in one order (two
// float32 vector accumulators over 32-weight steps, then halved; the last k % 32 one by one), whatever M
// and the thread count: a row of x gets the same result bit for bit in any batch of up to MAX_ROWS rows.
// (Not the same as torch's GEMM, whose order is its own: engine/model.py uses this kernel only where the
// engine is not asked to be batch-invariant with every batch size.)

#include <torch/library.h>

#include "cpu_vec.h"

#include <type_traits>
#include <vector>

namespace {

using namespace infermesh_cpu;

constexpr int64_t MAX_ROWS = 8;
constexpr int64_t AHEAD_BYTES = 2048;

// A 32-weight step as two float32 vectors. bf16: a 64-byte load holds them, and as 16 32-bit lanes
// (lane << 16) are the even weights and (lane & 0xFFFF0000) the odd ones: no widening shuffles.
template <typename T>
inline void load_step(const T* w, f32x16& a, f32x16& b) {
  a = load16(w), b = load16(w + 16);
}
template <>
inline void load_step(const c10::BFloat16* w, f32x16& a, f32x16& b) {
  u32x16 pairs;
  std::memcpy(&pairs, w, sizeof pairs);
  a = (f32x16)(pairs << 16), b = (f32x16)(pairs & 0xFFFF0000u);
}

// x [k] as float32 in the order load_step gives a step's weights (bf16: each 32's even, then odd positions).
template <typename T>
void arrange_x(const T* x, float* out, int64_t k) {
  int64_t c = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    for (; c + 32 <= k; c += 32)
      for (int64_t i = 0; i < 16; ++i)
        out[c + i] = to_float(x[c + 2 * i]), out[c + 16 + i] = to_float(x[c + 2 * i + 1]);
  for (; c < k; ++c) out[c] = to_float(x[c]);
}

// y[g * n] = <w, x[g]> for the M rows of x (arranged, row stride k): one pass over the weight row.
template <int M, typename T>
void dot_rows(const T* w, const float* x, int64_t k, T* y, int64_t n) {
  f32x16 even[M] = {}, odd[M] = {};
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    for (int64_t b = 0; b < 32 * static_cast<int64_t>(sizeof(T)); b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(w + c) + AHEAD_BYTES + b);
    f32x16 a, b;
    load_step(w + c, a, b);
    for (int g = 0; g < M; ++g) {
      even[g] += a * load16(x + g * k + c);
      odd[g] += b * load16(x + g * k + c + 16);
    }
  }
  for (int g = 0; g < M; ++g) {
    float sum = sum16(even[g] + odd[g]);
    for (int64_t t = c; t < k; ++t) sum += to_float(w[t]) * x[g * k + t];
    y[g * n] = static_cast<T>(sum);
  }
}

template <int M, typename T>
void run(const T* w, int64_t stride, const float* x, int64_t k, T* y, int64_t n) {
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dot_rows<M>(w + r * stride, x, k, y + r, n);
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1 && weight.stride(0) >= weight.size(1),
              "weight must be [N, K] with rows of unit stride, got ", weight.sizes(), " strides ", weight.strides());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1) && x.scalar_type() == weight.scalar_type(), "x must be [M, ",
              weight.size(1), "] in ", weight.scalar_type(), ", got ", x.sizes(), " in ", x.scalar_type());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "x must have 1 to ", MAX_ROWS, " rows, got ", x.size(0));
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1), stride = weight.stride(0);
  at::Tensor out = at::empty({m, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear", [&] {
    std::vector<float> xf(m * k);  // [M, K] in float32, arranged
    const at::Tensor xc = x.contiguous();
    for (int64_t i = 0; i < m; ++i) arrange_x(xc.data_ptr<scalar_t>() + i * k, xf.data() + i * k, k);
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    switch (m) {
      case 1: return run<1>(w, stride, xf.data(), k, y, n);
      case 2: return run<2>(w, stride, xf.data(), k, y, n);
      case 3: return run<3>(w, stride, xf.data(), k, y, n);
      case 4: return run<4>(w, stride, xf.data(), k, y, n);
      case 5: return run<5>(w, stride, xf.data(), k, y, n);
      case 6: return run<6>(w, stride, xf.data(), k, y, n);
      case 7: return run<7>(w, stride, xf.data(), k, y, n);
      default: return run<8>(w, stride, xf.data(), k, y, n);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infermesh_cpu, m) {
  m.def("linear(Tensor x, Tensor weight) -> Tensor", &linear);
}
