// A decode-only step's decoder layers in one call, for a dense model on CPU (engine/model.py, Transformer).
//
// infermesh_cpu::decode_layers(x [B, D], norms [2 L + 1], qk_norms [2 L] or [], projections [4 L],
//                              scales [4 L] or [], k_caches [L], v_caches [L], cos, sin, slot_mapping,
//                              block_tables, context_lens, kv_head, scale, Hq, eps, batch_invariant=True)
//     -> the final norm of the last layer's output [B, D]
//
// Each layer: h = rms_norm(x); qkv = linear(h), then (qwen3) each q and k head's row normed; attention as
// decode_attention (RoPE, the cache write, paged attention); x, h = add_rms_norm(x, linear(attn)); y = silu(gate)
// * up of linear(h); x, h = add_rms_norm(x, linear(y)) with the next layer's input norm (the final norm after the
// last). norms: per layer its input and post-attention norm weights, then the final norm's; qk_norms: per layer
// its q and k norm weights, or none; projections: per layer qkv, o, gate_up, down, bf16 [N, K] or int8 with
// `scales` (one tensor each; `batch_invariant` as linear_int8 takes it). The ops are the library's own, called
// directly: the same results bit for bit as the model's Python layer calls them one by one, without a return to
// Python and the dispatcher between them (bench/RESULTS.md, "the decoder layers in one call").

#include <torch/library.h>

#include "cpu_vec.h"

namespace {

using namespace infermesh_cpu;

at::Tensor decode_layers(at::Tensor x, at::TensorList norms, at::TensorList qk_norms, at::TensorList projections,
                         at::TensorList scales, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                         const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& kv_heads, double scale,
                         int64_t heads, double eps, bool batch_invariant) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(v_caches.size() == k_caches.size() && norms.size() == 2 * layers + 1 &&
                  (qk_norms.empty() || qk_norms.size() == 2 * layers) && projections.size() == 4 * layers &&
                  (scales.empty() || scales.size() == projections.size()),
              "decode_layers: ", layers, " layers need ", layers, " v caches, ", 2 * layers + 1, " norms, ",
              2 * layers, " q/k norms or none, ", 4 * layers, " projections and as many scales or none; got ",
              v_caches.size(), ", ", norms.size(), ", ", qk_norms.size(), ", ", projections.size(), ", ",
              scales.size());
  const auto project = [&](const at::Tensor& in, int64_t i) {
    return scales.empty() ? direct::linear(in, projections[i])
                          : direct::linear_int8(in, projections[i], scales[i], batch_invariant);
  };
  at::Tensor h = direct::rms_norm(x, norms[0], eps);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor qkv = project(h, 4 * l);  // [B, (Hq + 2 Hkv) D]
    if (!qk_norms.empty()) {  // each q and k head's row normed in place, as engine/model.py's Attention does
      const int64_t dim = k_caches[l].size(3), q_width = heads * dim, k_width = k_caches[l].size(2) * dim;
      const auto norm_heads = [&](int64_t first, int64_t width, const at::Tensor& weight) {
        at::Tensor part = qkv.narrow(1, first, width);  // [B, H D]
        part.copy_(direct::rms_norm(part.reshape({-1, dim}), weight, eps).view(part.sizes()));
      };
      norm_heads(0, q_width, qk_norms[2 * l]);
      norm_heads(q_width, k_width, qk_norms[2 * l + 1]);
    }
    const at::Tensor attn = direct::decode_attention(qkv, cos, sin, k_caches[l], v_caches[l], slots, tables, lens,
                                                     kv_heads, scale, heads);  // [B, Hq * D]
    std::tie(x, h) = direct::add_rms_norm(x, project(attn, 4 * l + 1), norms[2 * l + 1], eps);
    const at::Tensor gate_up = project(h, 4 * l + 2);  // [B, 2 I]
    const int64_t inner = gate_up.size(1) / 2;
    const at::Tensor y = at::silu(gate_up.narrow(1, 0, inner)).mul_(gate_up.narrow(1, inner, inner));  // [B, I]
    std::tie(x, h) = direct::add_rms_norm(x, project(y, 4 * l + 3), norms[2 * l + 2], eps);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infermesh_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor[] norms, Tensor[] qk_norms, Tensor[] projections, Tensor[] scales, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor kv_head, float scale, int heads, float eps, "
        "bool batch_invariant=True) -> Tensor",
        &decode_layers);
}
