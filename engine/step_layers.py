"""A step's decoder layers in one C++ call on CPU (engine/kernels/cpu_step_layers.cpp).

Between its projections a batch-1 decode step on SmolLM2 makes ~10 small calls a layer (norms, attention,
SiLU, adds), each back through Python and torch's dispatcher, each with its code and data evicted from cache
by the projection before it: ~4 ms of a ~18 ms step; a
short prompt's prefill chunk ~15 a layer. The C++ op chains the same kernels for every layer (and torch's
SDPA for a chunk where the model's layers call it), so a step computes the same bits either way.

`StepLayers.of(model)` says once whether a model's layers can take it: dense SwiGLU layers (with q/k
norms in every layer or none) without biases, paged attention not replaced (context parallelism), plain
GQA heads and no forward hooks (tensor parallelism's head maps and all-reduces), every projection
bf16/fp16/fp32 (`Linear`) or int8 (`Int8Linear`), one norm epsilon. The model reads it at its first step,
complete by then (quantized, sharded, in huge pages). Per step (decode rows, prefill chunks or both),
`__call__` returns the final norm's output, or None where the step is not for it (more rows than the few-row
kernel takes, a layer hook set for this step, no kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.kernels import cpu_decode, cpu_ops, cpu_prefill
from engine.quantize import Int8Linear, kernel_rows

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class StepLayers:
    layers: nn.ModuleList  # (to see hooks set for one step)
    norms: tuple[torch.Tensor, ...]  # per layer input and post-attention norm weights, then the final norm's
    qk_norms: tuple[torch.Tensor, ...]  # per layer q and k norm weights (qwen3), or none
    projections: tuple[torch.Tensor, ...]  # per layer qkv, o, gate_up, down
    scales: tuple[torch.Tensor, ...]  # the int8 projections' scales, or none
    kv_heads: torch.Tensor  # [Hq] the KV head of each query head: plain GQA
    scale: float
    heads: int
    eps: float
    max_rows: int  # the rows every projection takes through the few-row kernel
    batch_invariant: bool  # int8: as the projections take it (Int8Linear.batch_invariant)
    prefill_kernel: bool  # prefill chunks attend with cpu_prefill's kernel (else torch's SDPA), as paged_attention

    @classmethod
    def of(cls, model) -> StepLayers | None:
        """The one call's arguments for `model` (an engine.model.Transformer), or None where it does not fit."""
        layers, norms, qk_norms, projections = model.layers, [], [], []
        for layer in layers:
            attn = layer.self_attn
            if attn.attend is not paged_attention or attn.kv_head_map is not None \
                    or not hasattr(layer.mlp, "down_proj"):
                return None  # context parallelism's attention, tensor parallelism's heads, an MoE layer
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            qk_norms += [attn.q_norm, attn.k_norm]
            projections += [layer.get_submodule(name) for name in PROJECTIONS]
        norms.append(model.norm)
        if any(m._forward_hooks or m._forward_pre_hooks for layer in layers for m in layer.modules()):
            return None
        int8 = all(isinstance(p, Int8Linear) for p in projections)
        if not (int8 or all(isinstance(p, nn.Linear) for p in projections)) or any(p.bias is not None
                                                                                   for p in projections):
            return None
        present = [n is not None for n in qk_norms]
        if any(present) and not all(present):  # q/k norms in every layer (qwen3) or in none
            return None
        qk_norms = [n for n in qk_norms if n is not None]
        if len({n.eps for n in norms + qk_norms}) != 1:
            return None
        attn = layers[0].self_attn
        max_rows = kernel_rows(norms[0].weight.dtype) if int8 else min(getattr(p, "few_rows", 0) for p in projections)
        return cls(layers=layers, norms=tuple(n.weight for n in norms), qk_norms=tuple(n.weight for n in qk_norms),
                   projections=tuple(p.weight for p in projections),
                   scales=tuple(p.scale for p in projections) if int8 else (), scale=attn.scale,
                   kv_heads=cpu_decode.gqa_heads(attn.num_heads, attn.num_kv_heads),
                   heads=attn.num_heads, eps=norms[0].eps, max_rows=max_rows,
                   batch_invariant=all(getattr(p, "batch_invariant", True) for p in projections),
                   prefill_kernel=cpu_prefill.takes_heads(norms[0].weight.dtype, attn.head_dim))

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 kv_cache: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor | None:
        if x.shape[0] > self.max_rows or self.layers[0]._forward_hooks:
            return None
        if not cpu_ops.takes(x, self.norms[0], kv_cache[0][0]):
            return None
        spans = [n for s in meta.prefills for n in (s.start, s.num_tokens, s.context_len)]
        return cpu_ops.ops().step_layers(x, self.norms, self.qk_norms, self.projections, self.scales,
                                         [k for k, _ in kv_cache], [v for _, v in kv_cache], rope[0], rope[1],
                                         meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                                         self.kv_heads, self.scale, self.heads, self.eps, self.batch_invariant,
                                         spans, [s.block_table for s in meta.prefills],
                                         [s.mask for s in meta.prefills], self.prefill_kernel)
