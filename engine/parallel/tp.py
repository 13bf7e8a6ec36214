"""Tensor parallelism applied to a built `Transformer` from outside (gpt-fast style).

Column-parallel: the fused qkv projection (by query heads and the KV heads they
read) and gate/up (by intermediate rows). Row-parallel: o_proj and down_proj,
whose partial outputs are summed by an `AllReducer` (flat/tree/ring by size,
symmetric-memory one-shot/two-shot on CUDA) in a forward hook. Vocab-parallel
embedding (rows of the table; out-of-range ids contribute zero, then the same
all-reduce) and LM head (local logits, then all-gather). Those are the only
collectives of a TP step. Without expert parallelism, MoE experts are
split along their intermediate dimension like a dense MLP.

Heads need not divide evenly: each rank takes a contiguous, balanced range of
query heads and the contiguous range of KV heads they use, so a KV head is
replicated on every rank whose query heads need it (SmolLM2: 9 heads, 3 KV heads,
tp=2 -> heads 0-3 with KV 0-1, heads 4-8 with KV 1-2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model import Attention, DenseMLP, Transformer
from engine.moe import SparseMoE
from engine.parallel.allreduce import AllReducer, default_thresholds
from engine.parallel.context import ParallelContext


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `size` items are cut into `parts` balanced contiguous ranges."""
    return index * size // parts, (index + 1) * size // parts


@dataclass(frozen=True, slots=True)
class HeadShard:
    q_heads: tuple[int, int]  # [start, end) of global query heads
    kv_heads: tuple[int, int]  # [start, end) of global KV heads those query heads read

    def kv_head_map(self, cfg: ModelConfig) -> list[int]:
        """Local KV head of each local query head."""
        group = cfg.num_heads // cfg.num_kv_heads
        return [h // group - self.kv_heads[0] for h in range(*self.q_heads)]


def head_shard(cfg: ModelConfig, tp: int, rank: int) -> HeadShard:
    q0, q1 = split_range(cfg.num_heads, tp, rank)
    group = cfg.num_heads // cfg.num_kv_heads
    return HeadShard((q0, q1), (q0 // group, (q1 - 1) // group + 1))


def max_kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    return max(s.kv_heads[1] - s.kv_heads[0] for s in (head_shard(cfg, tp, r) for r in range(tp)))


def shard_for_tp(model: Transformer, ctx: ParallelContext, *, shard_experts: bool) -> None:
    """Shard `model` in place for this rank; experts too unless expert parallelism holds them."""
    group, tp, rank = ctx.tp_group, ctx.config.tp, ctx.tp_rank
    cfg = model.config
    weight = model.embed_tokens.weight
    thresholds = ctx.config.all_reduce or default_thresholds(weight.device)
    reducer = AllReducer(group, thresholds, weight.device, weight.dtype)
    reduce = _all_reduce_output(reducer)
    for layer in model.layers:
        _shard_attention(layer.self_attn, cfg, head_shard(cfg, tp, rank))
        layer.self_attn.o_proj.register_forward_hook(reduce)
        mlp = layer.mlp
        if isinstance(mlp, DenseMLP):
            _shard_dense_mlp(mlp, tp, rank)
            mlp.down_proj.register_forward_hook(reduce)
        elif isinstance(mlp, SparseMoE) and shard_experts:
            i0, i1 = split_range(cfg.moe_intermediate_size, tp, rank)
            inter = cfg.moe_intermediate_size
            gate_up = torch.cat([mlp.w_gate_up[:, i0:i1], mlp.w_gate_up[:, inter + i0:inter + i1]], 1)  # [E, 2I/tp, D]
            mlp.w_gate_up = nn.Parameter(gate_up, requires_grad=False)
            mlp.w_down = nn.Parameter(mlp.w_down[:, :, i0:i1].clone(), requires_grad=False)  # [E, D, I/tp]
            mlp.register_forward_hook(reduce)
    v0, v1 = split_range(cfg.vocab_size, tp, rank)
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight[v0:v1].clone(), v0, reducer)  # [V/tp, D]
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    else:
        keep_rows(model.lm_head, torch.arange(v0, v1))
    model.lm_head = VocabParallelLMHead(model.lm_head, cfg.vocab_size, group)


def keep_rows(linear: nn.Module, rows: torch.Tensor) -> None:
    """Column parallelism: keep these output rows of a linear layer (weight, bias, int8 scale)."""
    for name in ("weight", "bias", "scale"):
        if getattr(linear, name, None) is not None:
            setattr(linear, name, nn.Parameter(getattr(linear, name)[rows], requires_grad=False))


def keep_columns(linear: nn.Module, start: int, end: int) -> None:
    """Row parallelism: keep input columns [start, end) (an int8 layer keeps its rows' scales)."""
    linear.weight = nn.Parameter(linear.weight[:, start:end].clone(), requires_grad=False)


def _all_reduce_output(reducer: AllReducer):
    def hook(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return reducer(output)

    return hook


def _shard_attention(attn: Attention, cfg: ModelConfig, shard: HeadShard) -> None:
    d = cfg.head_dim
    (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    rows = torch.cat([torch.arange(q0 * d, q1 * d),
                      q_size + torch.arange(k0 * d, k1 * d),
                      q_size + kv_size + torch.arange(k0 * d, k1 * d)])
    keep_rows(attn.qkv_proj, rows)  # [(q+2kv)/tp, D]
    keep_columns(attn.o_proj, q0 * d, q1 * d)  # [D, q/tp]
    attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
    local_map = shard.kv_head_map(cfg)
    plain_gqa = attn.num_heads % attn.num_kv_heads == 0 and local_map == [
        h // (attn.num_heads // attn.num_kv_heads) for h in range(attn.num_heads)]
    attn.kv_head_map = None if plain_gqa else torch.tensor(local_map, device=attn.qkv_proj.weight.device)


def _shard_dense_mlp(mlp: DenseMLP, tp: int, rank: int) -> None:
    inter = mlp.down_proj.weight.shape[1]
    i0, i1 = split_range(inter, tp, rank)
    keep_rows(mlp.gate_up_proj, torch.cat([torch.arange(i0, i1), torch.arange(inter + i0, inter + i1)]))  # [2I/tp, D]
    keep_columns(mlp.down_proj, i0, i1)  # [D, I/tp]


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rows: torch.Tensor, first_id: int, reducer: AllReducer) -> None:
        super().__init__()
        self.weight = nn.Parameter(rows, requires_grad=False)  # [V_local, D]
        self.first_id, self.reduce = first_id, reducer

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.first_id
        held = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * held[:, None].to(self.weight.dtype)
        return self.reduce(x)  # [T, D]


class VocabParallelLMHead(nn.Module):
    def __init__(self, head: nn.Module, vocab_size: int, group) -> None:
        super().__init__()
        self.head = head  # this rank's rows: [V_local, D]
        self.vocab_size, self.group = vocab_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        world = self.group.size()
        widths = [split_range(self.vocab_size, world, r) for r in range(world)]
        widest = max(end - start for start, end in widths)
        local = self.head(hidden)  # [N, V_local]
        padded = F.pad(local, (0, widest - local.shape[1])).contiguous()  # [N, widest]
        gathered = padded.new_empty((world, *padded.shape))  # [W, N, widest]
        self.group._allgather_base(gathered.view(-1), padded.view(-1)).wait()
        return torch.cat([gathered[r, :, : end - start] for r, (start, end) in enumerate(widths)], dim=1)  # [N, V]
