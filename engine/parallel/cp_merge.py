"""Partial attention with log-sum-exp, and the exact merge of partials.

Ring attention computes, for one query block, attention over one KV block at a
time. Each partial is (O_s, LSE_s); the exact result over all blocks is

    O = Σ_s O_s · exp(LSE_s − LSE_max) / Σ_s exp(LSE_s − LSE_max),
    LSE = LSE_max + log Σ_s exp(LSE_s − LSE_max).

A query that sees no key in a block has LSE_s = −inf and weight 0 there.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_prefill


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Tq, D], k/v [B, H, Tk, D], mask broadcastable to [B, H, Tq, Tk] bool (True = attend), or
    `causal` (query i sees keys <= i) -> (O [B, H, Tq, D] float32, LSE [B, H, Tq] float32; -inf where a
    query sees no key)."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
    if mask is None and q.shape[0] == 1 and (not causal or q.shape[2] == k.shape[2]) and cpu_prefill.takes(q, k):
        rows = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, H, D] views
        out, lse = cpu_prefill.prefill_attention(*rows, scale, causal)  # [Tq, H, D], [Tq, H]
        return out.float().transpose(0, 1)[None], lse.transpose(0, 1)[None]
    if q.device.type == "cpu":
        # The fused CPU flash kernel returns the LSE SDPA hides (7x faster than the math below at 2k tokens).
        additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=additive,
                                                                               scale=scale)
        out, lse = out.float(), lse.float()
    else:
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, Tq, Tk]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, Tq]
        out = torch.matmul(torch.exp(scores - lse.clamp(min=torch.finfo(torch.float32).min)[..., None]), v.float())
    if mask is not None and not causal:  # a query with no visible key: weight 0 in the merge (the kernel says LSE 0)
        sees_a_key = mask.any(dim=-1).expand(lse.shape)
        lse = torch.where(sees_a_key, lse, float("-inf"))
        out = torch.where(sees_a_key[..., None], out, 0.0).nan_to_num(0.0)
    return out, lse


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D], mask [Tq, Tk] bool (True = attend) -> (O [Tq, Hq, D], LSE [Tq, Hq]) in fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]  # [1, Hq, Tk, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    out, lse = attention_with_lse(q.transpose(0, 1)[None], k, v, None if mask is None else mask[None, None], scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)  # [Tq, Hq, D], [Tq, Hq]


def merge_partials(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outputs [S, T, H, D], lses [S, T, H] -> (O [T, H, D], LSE [T, H])."""
    if outputs.is_cuda:
        from engine.kernels.lse_merge import merge_lse  # Triton: CUDA only

        return merge_lse(outputs.float(), lses.float())
    lse_max = lses.max(dim=0).values  # [T, H]
    finite_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    weights = torch.exp(lses - finite_max)  # [S, T, H]; exp(-inf) = 0
    total = weights.sum(dim=0)  # [T, H]
    out = (outputs * weights[..., None]).sum(dim=0) / total.clamp(min=torch.finfo(total.dtype).tiny)[..., None]
    return out, finite_max + torch.log(total)
