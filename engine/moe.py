"""Mixture-of-experts block: top-k gating and grouped expert compute.

`route` is the gating math (softmax in float32, top-k, optional renormalisation,
as Mixtral and Qwen3-MoE define it); `experts_forward` runs a set of experts over
the tokens routed to them. Both are plain functions so that expert parallelism can
call them on either side of its all-to-all without touching this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_forward(
    x: torch.Tensor,  # [T, D]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k] global expert ids
    w_gate_up: torch.Tensor,  # [E_local, 2I, D]
    w_down: torch.Tensor,  # [E_local, D, I]
    first_expert: int = 0,  # global id of w_gate_up[0]
) -> torch.Tensor:
    """Σ_k weight·expert(x) over the experts held here; other experts contribute 0."""
    out = torch.zeros_like(x)
    top_k, num_local = ids.shape[1], w_gate_up.shape[0]
    flat_ids = ids.flatten()  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
    held = torch.arange(first_expert, first_expert + num_local + 1, device=ids.device)
    bounds = torch.searchsorted(flat_ids[order], held).tolist()
    flat_weights = weights.flatten().to(x.dtype)
    for local in range(num_local):
        begin, end = bounds[local], bounds[local + 1]
        if begin == end:
            continue
        slots = order[begin:end]
        rows = slots // top_k  # token row of each slot
        gate, up = F.linear(x[rows], w_gate_up[local]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w_down[local])  # [n, D]
        out.index_add_(0, rows, y * flat_weights[slots, None])
    return out


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.first_expert = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return experts_forward(x, weights, ids, self.w_gate_up, self.w_down, self.first_expert)
