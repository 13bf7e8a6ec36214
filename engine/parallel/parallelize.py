"""Apply a parallel layout to a built model, from outside: the model code stays single-rank."""

from __future__ import annotations

from engine.model import Transformer
from engine.parallel.context import ParallelContext
from engine.parallel.ep import shard_for_ep
from engine.parallel.tp import shard_for_tp


def parallelize(model: Transformer, ctx: ParallelContext) -> Transformer:
    cfg = ctx.config
    if cfg.tp > 1:
        shard_for_tp(model, ctx, shard_experts=cfg.ep == 1)
    if cfg.ep > 1:
        shard_for_ep(model, ctx)
    return model
