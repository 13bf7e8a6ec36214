"""MoE layers whose experts live in another instance: attention ranks and expert ranks in one group.

An attention instance (prefill or decode, W ranks) attached to an expert instance (R ranks) shares
with it one process group of W + R ranks, attention ranks first, named by the expert instance and
formed over its rendezvous store (`ExpertAttachment` in the parallel config; `connect` joins it).
At every MoE layer each attention rank routes the tokens it is responsible for — its 1/W share when
the instance's ranks hold the same tokens (TP), every row of its own under CP — and exchanges them
with the expert ranks two-shot
(`ExpertExchange`: counts, then rows); shared results are all-gathered back inside the instance.
Expert ranks run `serve_attachment`: the same exchange, layer after layer, with no tokens of their
own, so one attachment's steps never mix with another's (each has its own group and thread).

A dead peer makes the next exchange raise: gloo notices a closed connection at once, and the group
timeout (`ExpertAttachment.timeout_s`) bounds a peer that hangs.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.heap import keep_freed_heap
from engine.moe import SparseMoE, route
from engine.parallel.ep import ExpertExchange, expert_placement, gather_shares
from engine.parallel.tp import split_range


def experts_per_rank(num_experts: int, attention_ranks: int, expert_ranks: int) -> list[int]:
    """Experts held by each rank of an attachment group: none on the attention ranks."""
    placement = expert_placement(num_experts, expert_ranks)
    return [0] * attention_ranks + [placement.count(r) for r in range(expert_ranks)]


class AttachedMoE(nn.Module):
    """The attention side of a MoE layer: gate and top-k here, experts on the expert ranks."""

    def __init__(self, moe: SparseMoE, group, attention_ranks: int, share_group=None) -> None:
        super().__init__()
        self.gate, self.top_k, self.renormalize = moe.gate, moe.top_k, moe.renormalize
        num_experts, hidden = moe.w_gate_up.shape[0], moe.w_gate_up.shape[2]
        counts = experts_per_rank(num_experts, attention_ranks, group.size() - attention_ranks)
        none = moe.w_gate_up.new_empty((0, 0, hidden))
        self.exchange = ExpertExchange(group, counts, none, none)
        self.share_group = share_group  # the instance ranks holding the same tokens (TP), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D]
        if self.share_group is None:
            weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # [T, k] each
            return self.exchange.run(x, weights, ids)
        world, rank = self.share_group.size(), self.share_group.rank()
        start, end = split_range(x.shape[0], world, rank)
        mine = x[start:end]  # [t, D]
        weights, ids = route(self.gate(mine), self.top_k, self.renormalize)
        return gather_shares(self.share_group, self.exchange.run(mine, weights, ids), x.shape[0])


def attach_experts(model: nn.Module, group, attention_ranks: int, share_group=None) -> None:
    """Replace every SparseMoE of `model` by its attached form (its expert weights are dropped)."""
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp = AttachedMoE(layer.mlp, group, attention_ranks, share_group)


class ExpertShard:
    """One expert rank's experts of every MoE layer of a model, and what they computed."""

    def __init__(self, model: nn.Module, rank: int, expert_ranks: int) -> None:
        moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
        if not moes:
            raise ValueError(f"{model.config.architecture} has no mixture-of-experts layers to host")
        self.num_experts = moes[0].w_gate_up.shape[0]
        self.placement = expert_placement(self.num_experts, expert_ranks)
        local = [e for e, owner in enumerate(self.placement) if owner == rank]
        self.first_expert = local[0]
        self.weights = [(_own(m.w_gate_up[local[0]:local[-1] + 1]), _own(m.w_down[local[0]:local[-1] + 1]))
                        for m in moes]  # per layer
        self.hidden, self.dtype, self.top_k = moes[0].w_gate_up.shape[2], moes[0].w_gate_up.dtype, moes[0].top_k
        keep_freed_heap()  # the experts are in place: a step's buffers reuse freed pages, as an engine rank's


def _own(experts: torch.Tensor) -> torch.Tensor:
    """This rank's slice, apart from the model (shared upcycled experts stay one shared tensor)."""
    return experts.detach() if experts.stride(0) == 0 else experts.detach().clone()


@torch.inference_mode()
def serve_attachment(shard: ExpertShard, group, attention_ranks: int,
                     tokens_per_expert: torch.Tensor | None = None) -> None:
    """Run the expert side of every MoE layer of every step on `group` until a peer leaves (raises).
    `tokens_per_expert` [layers, local experts] accumulates the rows computed here."""
    counts = experts_per_rank(shard.num_experts, attention_ranks, group.size() - attention_ranks)
    exchanges = [ExpertExchange(group, counts, w_gate_up, w_down) for w_gate_up, w_down in shard.weights]
    if tokens_per_expert is not None:
        for layer, exchange in enumerate(exchanges):
            exchange.tokens_per_expert = tokens_per_expert[layer]  # a view: the exchange adds into it
    none = torch.empty(0, shard.hidden, dtype=shard.dtype)
    no_weights, no_ids = torch.empty(0, shard.top_k), torch.empty(0, shard.top_k, dtype=torch.long)
    while True:
        for exchange in exchanges:
            exchange.run(none, no_weights, no_ids)
