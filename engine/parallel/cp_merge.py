"""Partial attention with log-sum-exp, and the exact merge of partials.

Ring attention computes, for one query block, attention over one KV block at a
time. Each partial is (O_s, LSE_s); the exact result over all blocks is

    O = Σ_s O_s · exp(LSE_s − LSE_max) / Σ_s exp(LSE_s − LSE_max),
    LSE = LSE_max + log Σ_s exp(LSE_s − LSE_max).

A query that sees no key in a block has LSE_s = −inf and weight 0 there.
"""

from __future__ import annotations

import torch


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D], mask [Tq, Tk] bool (True = attend) -> (O [Tq, Hq, D], LSE [Tq, Hq]) in fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [Tk, Hq, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Tq]
    probs = torch.exp(scores - lse.clamp(min=torch.finfo(torch.float32).min)[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v)  # [Tq, Hq, D]
    return out, lse.transpose(0, 1)  # LSE [Tq, Hq]


def merge_partials(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outputs [S, T, H, D], lses [S, T, H] -> (O [T, H, D], LSE [T, H])."""
    lse_max = lses.max(dim=0).values  # [T, H]
    finite_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    weights = torch.exp(lses - finite_max)  # [S, T, H]; exp(-inf) = 0
    total = weights.sum(dim=0)  # [T, H]
    out = (outputs * weights[..., None]).sum(dim=0) / total.clamp(min=torch.finfo(total.dtype).tiny)[..., None]
    return out, finite_max + torch.log(total)
