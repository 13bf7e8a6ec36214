"""Expert parallelism: experts spread over ranks, tokens sent to the experts they chose and back.

Placement is explicit: `placement[e]` is the rank holding expert e, in
contiguous ascending ranges (`expert_placement` balances them). One MoE layer:

1. gate and top-k on the tokens this rank is responsible for;
2. sort the (token, choice) slots by expert id (which also groups them by rank);
3. shot one: exchange per-expert slot counts (`all_to_all_single`, one count per
   expert) so every rank knows how many rows arrive from whom for which expert;
4. shot two: the rows themselves, with those uneven splits;
5. grouped compute on the local experts; the reverse all-to-all returns results
   in the order they came; un-permute and weight by the gate.

No expert ids travel: the counts of shot one say which rows belong to which
expert. A rank may send or receive nothing. Attention is replicated over the
group (TP, or EP alone: the hidden states are the same on every rank), so each
rank dispatches only its 1/W share of the tokens and the results are
all-gathered: no token crosses the wire twice.
`tokens_per_expert` accumulates the rows each local expert computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.moe import SparseMoE, experts_forward, route
from engine.parallel.context import ParallelContext
from engine.parallel.tp import split_range


def expert_placement(num_experts: int, ep: int) -> tuple[int, ...]:
    """Owner rank of each expert: contiguous, balanced ranges."""
    if not 1 <= ep <= num_experts:
        raise ValueError(f"ep must be in [1, num_experts={num_experts}], got {ep}")
    return tuple(r for r in range(ep) for _ in range(*split_range(num_experts, ep, r)))


def all_to_all(group, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """`all_to_all_single` with uneven splits along dim 0."""
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    group.alltoall_base(out, rows.contiguous(), recv_splits, send_splits).wait()
    return out


class ExpertExchange:
    """Dispatch, compute and combine for one MoE layer over `group`, whose rank r holds
    `experts_per_rank[r]` experts (contiguous ascending ids; 0 for a rank that only sends tokens).
    `w_gate_up`/`w_down` are this rank's experts; every rank of the group calls `run` for every layer,
    with the tokens it dispatches (possibly none)."""

    def __init__(self, group, experts_per_rank: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        rank = group.rank()
        self.group, self.experts_per_rank = group, experts_per_rank
        self.num_local, self.first_expert = experts_per_rank[rank], sum(experts_per_rank[:rank])
        self.w_gate_up, self.w_down = w_gate_up, w_down  # [E_l, 2I, D], [E_l, D, I]
        self.tokens_per_expert = torch.zeros(self.num_local, dtype=torch.long)

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [t, D], gate weights and expert ids [t, k] -> Σ_k weight · expert(x): [t, D]."""
        world, top_k = self.group.size(), ids.shape[1]
        flat_ids = ids.flatten()  # [t*k]
        order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert, hence by rank
        per_expert = torch.bincount(flat_ids, minlength=sum(self.experts_per_rank))  # [E]
        arriving = all_to_all(self.group, per_expert, self.experts_per_rank, [self.num_local] * world)  # [W*E_l]
        arriving = arriving.view(world, self.num_local)  # rows from each source rank for each local expert
        send_splits = [int(c.sum()) for c in per_expert.split(self.experts_per_rank)]
        recv_splits = arriving.sum(1).tolist()
        rows = all_to_all(self.group, _permute(x, order // top_k), send_splits, recv_splits)  # [n, D]
        local_ids = torch.repeat_interleave(torch.arange(self.num_local).repeat(world), arriving.flatten())  # [n]
        self.tokens_per_expert += arriving.sum(0)
        computed = experts_forward(rows, torch.ones(len(rows), 1), local_ids[:, None] + self.first_expert,
                                   self.w_gate_up, self.w_down, self.first_expert)  # [n, D]
        back = all_to_all(self.group, computed, recv_splits, send_splits)  # [t*k, D], in `order`
        return _unpermute_and_weight(back, order, weights)  # [t, D]


class ExpertParallelMoE(nn.Module):
    def __init__(self, moe: SparseMoE, placement: tuple[int, ...], group) -> None:
        super().__init__()
        rank = group.rank()
        local = [e for e, owner in enumerate(placement) if owner == rank]
        if list(placement) != sorted(placement) or not local:
            raise ValueError(f"placement must give every rank a contiguous ascending range of experts, got {placement}")
        self.gate, self.top_k, self.renormalize = moe.gate, moe.top_k, moe.renormalize
        mine = slice(local[0], local[-1] + 1)
        self.w_gate_up = nn.Parameter(moe.w_gate_up[mine].clone(), requires_grad=False)  # [E_l, 2I, D]
        self.w_down = nn.Parameter(moe.w_down[mine].clone(), requires_grad=False)  # [E_l, D, I]
        self.group = group
        self.exchange = ExpertExchange(group, [placement.count(r) for r in range(group.size())], self.w_gate_up,
                                       self.w_down)

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.exchange.tokens_per_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D]
        world, rank = self.group.size(), self.group.rank()
        start, end = split_range(x.shape[0], world, rank)  # the tokens are the same on every rank: take a share
        mine = x[start:end]  # [t, D]
        weights, ids = route(self.gate(mine), self.top_k, self.renormalize)  # [t, k] each
        return gather_shares(self.group, self.exchange.run(mine, weights, ids), x.shape[0])


def gather_shares(group, y: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each rank computed rows `split_range(num_tokens, W, rank)` of a result: all of it, on every rank."""
    world = group.size()
    shares = [split_range(num_tokens, world, r) for r in range(world)]
    widest = max(end - start for start, end in shares)
    padded = F.pad(y, (0, 0, 0, widest - y.shape[0])).contiguous()  # [widest, D]
    gathered = padded.new_empty((world, *padded.shape))  # [W, widest, D]
    group._allgather_base(gathered.view(-1), padded.view(-1)).wait()
    return torch.cat([gathered[r, : end - start] for r, (start, end) in enumerate(shares)])  # [T, D]


def _permute(x: torch.Tensor, source_rows: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from engine.kernels.moe_permute import permute_rows  # Triton: CUDA only

        return permute_rows(x, source_rows)
    return x[source_rows]


def _unpermute_and_weight(back: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """back [t*k, D] in `order` -> Σ_j weights[t, j] · result of (t, j): [t, D]."""
    top_k = weights.shape[1]
    if back.is_cuda:
        from engine.kernels.moe_permute import combine_rows  # Triton: CUDA only

        slot_rows = torch.empty_like(order)
        slot_rows[order] = torch.arange(len(order), device=order.device)
        return combine_rows(back, slot_rows.view(-1, top_k), weights)
    slots = torch.empty_like(back)
    slots[order] = back
    return (slots.view(-1, top_k, back.shape[1]) * weights[..., None].to(back.dtype)).sum(1)


def shard_for_ep(model: nn.Module, ctx: ParallelContext) -> None:
    """Replace every SparseMoE of `model` by its expert-parallel form for this rank."""
    cfg = model.config
    placement = expert_placement(cfg.num_experts, ctx.config.ep)
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp = ExpertParallelMoE(layer.mlp, placement, ctx.ep_group)
