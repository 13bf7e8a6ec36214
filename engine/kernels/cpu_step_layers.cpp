// A step's decoder layers in one call, for a dense model on CPU (engine/model.py, Transformer).
//
// infermesh_cpu::step_layers(x [T, D], norms [2 L + 1], qk_norms [2 L] or [], projections [4 L],
//                            scales [4 L] or [], k_caches [L], v_caches [L], cos, sin, slot_mapping,
//                            block_tables?, context_lens?, kv_head, scale, Hq, eps, batch_invariant,
//                            spans [3 S], span_tables [S], span_masks [S], prefill_kernel)
//     -> the final norm of the last layer's output [T, D]
//
// The step's first `T - sum of span rows` rows are decode rows (block_tables, context_lens theirs); then each
// prefill chunk, spans giving its first row, rows and context length (a cached prefix and the chunk) and
// span_tables / span_masks its blocks and mask where it has a cached prefix (none where it has not).
//
// Each layer: h = rms_norm(x); qkv = linear(h), then (qwen3) each q and k head's row normed; the attention; x,
// h = add_rms_norm(x, linear(attn)); y = silu(gate) * up of linear(h); x, h = add_rms_norm(x, linear(y)) with
// the next layer's input norm (the final norm after the last). A decode-only step attends as decode_attention
// does (RoPE, the cache write, paged attention in one kernel); a step with prefill chunks as engine/model.py's
// Attention and engine/attention.py's paged_attention do, on the same views: RoPE, the cache write, paged_decode
// for the decode rows, and each chunk causally by torch's SDPA or, where `prefill_kernel`, prefill_attention.
// norms: per layer its input and post-attention norm weights, then the final norm's; qk_norms: per layer its q
// and k norm weights, or none; projections: per layer qkv, o, gate_up, down, bf16 [N, K] or int8 with `scales`
// (one tensor each; `batch_invariant` as linear_int8 takes it). The ops are the library's own (and torch's SDPA),
// called directly: the same results bit for bit as the model's Python layers calling them one by one, without a
// return to Python and the dispatcher between them.

#include <torch/library.h>

#include "cpu_vec.h"

#include <optional>
#include <vector>

namespace {

using namespace infermesh_cpu;

struct Span {  // a prefill chunk: rows [first, first + rows) of the step, attending to `context` tokens
  int64_t first, rows, context;
  std::optional<at::Tensor> table, mask;  // its blocks [blocks] int64 and mask [rows, context] where it has a prefix
};

// What a step's attention reads besides the layer's own tensors.
struct Step {
  const at::Tensor &cos, &sin, &slots, &kv_heads;
  const std::optional<at::Tensor> &tables, &lens;  // the decode rows'
  int64_t decode_rows;
  std::vector<Span> spans;
  double scale, eps;
  int64_t heads;
  bool prefill_kernel;
};

// t [rows, H, D] with each row's heads dense, as engine/kernels/cpu_prefill.py's _dense_rows
at::Tensor dense_rows(const at::Tensor& t) {
  return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

// A step with prefill chunks: engine/model.py's Attention.forward past its fused decode, and paged_attention.
at::Tensor chunks_attention(const at::Tensor& qkv, const at::Tensor* q_norm, const at::Tensor* k_norm,
                            at::Tensor k_cache, at::Tensor v_cache, const Step& step) {
  const int64_t kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const auto parts = qkv.split({step.heads * dim, kv_heads * dim, kv_heads * dim}, 1);
  at::Tensor q = parts[0].view({-1, step.heads, dim});  // [T, Hq, D]
  at::Tensor k = parts[1].view({-1, kv_heads, dim});    // [T, Hkv, D]
  const at::Tensor v = parts[2].view({-1, kv_heads, dim});
  if (q_norm != nullptr)
    q = direct::rms_norm(q.contiguous(), *q_norm, step.eps), k = direct::rms_norm(k.contiguous(), *k_norm, step.eps);
  direct::rope_(q, step.cos, step.sin);
  direct::rope_(k, step.cos, step.sin);
  k_cache.view({-1, kv_heads, dim}).index_copy_(0, step.slots, k);
  v_cache.view({-1, kv_heads, dim}).index_copy_(0, step.slots, v);
  std::vector<at::Tensor> outputs;  // [rows, Hq, D] each
  if (step.decode_rows)
    outputs.push_back(direct::paged_decode(q.narrow(0, 0, step.decode_rows).contiguous(), k_cache, v_cache,
                                           *step.tables, *step.lens, step.kv_heads, step.scale));
  const auto gather = [&](const at::Tensor& cache, const at::Tensor& table, int64_t context) {
    return cache.index_select(0, table).view({-1, kv_heads, dim}).narrow(0, 0, context);  // [context, Hkv, D]
  };
  for (const Span& span : step.spans) {
    const at::Tensor qs = q.narrow(0, span.first, span.rows);
    at::Tensor ks = span.table ? gather(k_cache, *span.table, span.context) : k.narrow(0, span.first, span.rows);
    at::Tensor vs = span.table ? gather(v_cache, *span.table, span.context) : v.narrow(0, span.first, span.rows);
    if (step.prefill_kernel) {
      ks = dense_rows(ks), vs = dense_rows(vs);
      if (ks.stride(0) != vs.stride(0)) ks = ks.contiguous(), vs = vs.contiguous();
      outputs.push_back(std::get<0>(direct::prefill_attention(dense_rows(qs), ks, vs, step.kv_heads, step.scale,
                                                              true)));
      continue;
    }
    const at::Tensor o = at::scaled_dot_product_attention(  // [1, Hq, rows, D]
        qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
        span.mask, 0.0, !span.mask.has_value(), step.scale, true);
    outputs.push_back(o.select(0, 0).transpose(0, 1));
  }
  return (outputs.size() == 1 ? outputs[0] : at::cat(outputs)).flatten(1);  // [T, Hq * D]
}

at::Tensor step_layers(at::Tensor x, at::TensorList norms, at::TensorList qk_norms, at::TensorList projections,
                       at::TensorList scales, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& slots, const std::optional<at::Tensor>& tables,
                       const std::optional<at::Tensor>& lens, const at::Tensor& kv_heads, double scale, int64_t heads,
                       double eps, bool batch_invariant, at::IntArrayRef spans,
                       const c10::List<std::optional<at::Tensor>>& span_tables,
                       const c10::List<std::optional<at::Tensor>>& span_masks, bool prefill_kernel) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(v_caches.size() == k_caches.size() && norms.size() == 2 * layers + 1 &&
                  (qk_norms.empty() || qk_norms.size() == 2 * layers) && projections.size() == 4 * layers &&
                  (scales.empty() || scales.size() == projections.size()),
              "step_layers: ", layers, " layers need ", layers, " v caches, ", 2 * layers + 1, " norms, ",
              2 * layers, " q/k norms or none, ", 4 * layers, " projections and as many scales or none; got ",
              v_caches.size(), ", ", norms.size(), ", ", qk_norms.size(), ", ", projections.size(), ", ",
              scales.size());
  const int64_t chunks = static_cast<int64_t>(spans.size()) / 3;
  TORCH_CHECK(spans.size() % 3 == 0 && span_tables.size() == chunks && span_masks.size() == chunks,
              "step_layers: spans must hold (first row, rows, context) for each of its chunks and span_tables and "
              "span_masks one entry each; got ", spans.size(), " numbers, ", span_tables.size(), " tables and ",
              span_masks.size(), " masks");
  Step step{cos, sin, slots, kv_heads, tables, lens, x.size(0), {}, scale, eps, heads, prefill_kernel};
  for (int64_t s = 0; s < chunks; ++s) {
    const Span span{spans[3 * s], spans[3 * s + 1], spans[3 * s + 2], span_tables.get(s), span_masks.get(s)};
    TORCH_CHECK(span.rows >= 1 && span.first >= 0 && span.first + span.rows <= x.size(0) &&
                    span.context >= span.rows && span.table.has_value() == (span.context > span.rows),
                "step_layers: chunk ", s, " (rows ", span.first, " + ", span.rows, ", context ", span.context,
                ") does not fit a step of ", x.size(0), " rows, or has a prefix without its blocks");
    step.decode_rows -= span.rows;
    step.spans.push_back(span);
  }
  TORCH_CHECK(step.decode_rows >= 0 && (step.decode_rows == 0 || (tables.has_value() && lens.has_value())),
              "step_layers: decode rows need their block tables and context lengths");
  const auto project = [&](const at::Tensor& in, int64_t i) {
    return scales.empty() ? direct::linear(in, projections[i])
                          : direct::linear_int8(in, projections[i], scales[i], batch_invariant);
  };
  at::Tensor h = direct::rms_norm(x, norms[0], eps);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor qkv = project(h, 4 * l);  // [T, (Hq + 2 Hkv) D]
    const at::Tensor *q_norm = qk_norms.empty() ? nullptr : &qk_norms[2 * l];
    const at::Tensor *k_norm = qk_norms.empty() ? nullptr : &qk_norms[2 * l + 1];
    at::Tensor attn;  // [T, Hq * D]
    if (!step.spans.empty()) {
      attn = chunks_attention(qkv, q_norm, k_norm, k_caches[l], v_caches[l], step);
    } else {
      if (q_norm != nullptr) {  // each q and k head's row normed in place, as engine/model.py's Attention does
        const int64_t dim = k_caches[l].size(3), q_width = heads * dim, k_width = k_caches[l].size(2) * dim;
        const auto norm_heads = [&](int64_t first, int64_t width, const at::Tensor& weight) {
          at::Tensor part = qkv.narrow(1, first, width);  // [T, H D]
          part.copy_(direct::rms_norm(part.reshape({-1, dim}), weight, eps).view(part.sizes()));
        };
        norm_heads(0, q_width, *q_norm);
        norm_heads(q_width, k_width, *k_norm);
      }
      attn = direct::decode_attention(qkv, cos, sin, k_caches[l], v_caches[l], slots, *tables, *lens, kv_heads,
                                      scale, heads);
    }
    std::tie(x, h) = direct::add_rms_norm(x, project(attn, 4 * l + 1), norms[2 * l + 1], eps);
    const at::Tensor gate_up = project(h, 4 * l + 2);  // [T, 2 I]
    const int64_t inner = gate_up.size(1) / 2;
    const at::Tensor y = at::silu(gate_up.narrow(1, 0, inner)).mul_(gate_up.narrow(1, inner, inner));  // [T, I]
    std::tie(x, h) = direct::add_rms_norm(x, project(y, 4 * l + 3), norms[2 * l + 2], eps);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infermesh_cpu, m) {
  m.def("step_layers(Tensor x, Tensor[] norms, Tensor[] qk_norms, Tensor[] projections, Tensor[] scales, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor? block_tables, Tensor? context_lens, Tensor kv_head, float scale, int heads, float eps, "
        "bool batch_invariant, int[] spans, Tensor?[] span_tables, Tensor?[] span_masks, bool prefill_kernel) "
        "-> Tensor",
        &step_layers);
}
