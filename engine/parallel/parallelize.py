"""Apply a parallel layout to a built model, from outside: the model code stays single-rank."""

from __future__ import annotations

from engine.model import Transformer
from engine.parallel.context import ParallelContext
from engine.parallel.ep import shard_for_ep
from engine.parallel.expert_attach import attach_experts
from engine.parallel.tp import shard_for_tp


def parallelize(model: Transformer, ctx: ParallelContext) -> Transformer:
    cfg = ctx.config
    if cfg.tp > 1:
        shard_for_tp(model, ctx, shard_experts=cfg.ep == 1 and cfg.experts is None)
    if cfg.ep > 1:
        shard_for_ep(model, ctx)
    if cfg.experts is not None:  # TP ranks hold the same tokens: each dispatches a share; CP ranks their own rows
        attach_experts(model, ctx.expert_group, cfg.world_size, share_group=ctx.tp_group)
    return model
