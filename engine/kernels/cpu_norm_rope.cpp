// The row-wise steps of a decoder layer on CPU, each one pass over its rows instead of torch's chain of
// small ops (and their dispatch, ~2-3 ms of a 25 ms batch-1 step on SmolLM2).
//
// infermesh_cpu::rms_norm(x [..., D], weight [D], eps) -> [..., D]
// infermesh_cpu::add_rms_norm(x [..., D], delta [..., D], weight [D], eps) -> (x + delta, rms_norm(x + delta))
// infermesh_cpu::rope_(x [T, H, D], cos [T, ..., D], sin [T, ..., D]) -> x, rotated in place
//
// They compute what engine/model.py's RMSNorm and engine/attention.py's apply_rope compute with torch, in
// the same order, rounding to the dtype where torch rounds each op's result: float32 statistics, then
// `weight * (x * rstd).to(dtype)`; `x * cos + rotate_half(x) * sin` with rotate_half(x) = (-x2, x1). Only
// the order of a row's sum of squares (and, in float32, fused multiply-adds) differ. Their callers there
// check what they take: one dtype throughout (cpu_ops.takes), contiguous rows, heads with unit stride.

#include <torch/library.h>

#include "cpu_vec.h"

#include <cmath>
#include <tuple>

namespace {

using namespace infermesh_cpu;

constexpr int64_t PARALLEL_MIN = 1 << 15;  // elements: fewer run on the calling thread alone

inline float sum_in_sum16s_order(const f32x16 (&v)[1]) { return sum16(v[0]); }
inline float sum_in_sum16s_order(const f32x8 (&v)[2]) { return sum8(v[0] + v[1]); }  // sum16 adds halves first

template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t dim, float eps) {
  constexpr int L = lanes<f32xN>::n;
  f32xN squares[16 / L] = {};  // 16 columns a step on any CPU (two 8-lane halves without AVX-512) ...
  int64_t c = 0;
  for (; c + 16 <= dim; c += 16)
    for (int h = 0; h < 16 / L; ++h) {
      const f32xN v = load<f32xN>(x + c + h * L);
      squares[h] += v * v;
    }
  float sum = sum_in_sum16s_order(squares);  // ... and summed alike: the same bits on either
  for (; c < dim; ++c) sum += to_float(x[c]) * to_float(x[c]);
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (c = 0; c + L <= dim; c += L)
    store(out + c, load<f32xN>(weight + c) * rounded<T>(load<f32xN>(x + c) * rstd));
  for (; c < dim; ++c) out[c] = static_cast<T>(to_float(weight[c]) * to_float(static_cast<T>(to_float(x[c]) * rstd)));
}

template <typename T>
void add_row(const T* x, const T* delta, T* sum, int64_t dim) {
  constexpr int L = lanes<f32xN>::n;
  int64_t c = 0;
  for (; c + L <= dim; c += L) store(sum + c, load<f32xN>(x + c) + load<f32xN>(delta + c));
  for (; c < dim; ++c) sum[c] = static_cast<T>(to_float(x[c]) + to_float(delta[c]));
}

template <typename F>
void over_rows(int64_t rows, int64_t dim, const F& f) {
  if (rows * dim < PARALLEL_MIN) return f(0, rows);
  parallel_for(rows, f);
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "x must be contiguous, got strides ", x.strides());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(), "weight must be [",
              x.size(-1), "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight ", weight.scalar_type(), " and x ",
              x.scalar_type(), " must share a dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    over_rows(rows, dim, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(xp + r * dim, wp, op + r * dim, dim, static_cast<float>(eps));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.is_contiguous() && delta.scalar_type() == x.scalar_type(),
              "delta must be contiguous, ", x.scalar_type(), " ", x.sizes(), ", got ", delta.scalar_type(), " ",
              delta.sizes());
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *dp = delta.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t *sp = sum.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    over_rows(rows, dim, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row(xp + r * dim, dp + r * dim, sp + r * dim, dim);
        norm_row(sp + r * dim, wp, op + r * dim, dim, static_cast<float>(eps));
      }
    });
  });
  return {sum, out};
}

at::Tensor rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [T, H, D] with D even and "
              "contiguous, got ", x.sizes(), " strides ", x.strides());
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->size(0) == tokens && table->size(-1) == dim && table->stride(-1) == 1 &&
                    table->numel() == tokens * dim && table->scalar_type() == x.scalar_type(),
                "cos and sin must be [", tokens, ", ..., ", dim, "] in ", x.scalar_type(), ", got ", table->sizes(),
                " in ", table->scalar_type());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
    const int64_t token_stride = x.stride(0), head_stride = x.stride(1), table_stride = cos.stride(0);
    over_rows(tokens, heads * dim, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          rotate(xp + t * token_stride + h * head_stride, cp + t * table_stride, sp + t * table_stride, dim / 2);
    });
  });
  return x;
}

}  // namespace

namespace infermesh_cpu::direct {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  return ::add_rms_norm(x, delta, weight, eps);
}
at::Tensor rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) { return ::rope_(x, cos, sin); }
}  // namespace infermesh_cpu::direct

TORCH_LIBRARY_FRAGMENT(infermesh_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)", &rope_);
}
