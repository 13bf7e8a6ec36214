"""Build one rank's model runner: the model, sharded for the rank's layout from outside (the model code
stays single-rank), its KV cache (the rank's KV heads only), and the runner that fits the layout."""

from __future__ import annotations

import torch

from engine.heap import keep_freed_heap
from engine.huge_pages import to_huge_pages
from engine.kernels import cpu_ops
from engine.kv_cache import allocate_kv_cache
from engine.model import INVARIANT_ROWS, Linear, Transformer, build_model
from engine.parallel.context import ParallelContext
from engine.parallel.cp_runner import ContextParallelRunner
from engine.parallel.ep import shard_for_ep
from engine.parallel.expert_attach import attach_experts
from engine.parallel.tp import shard_for_tp
from engine.quantize import Int8Linear, quantize_int8
from engine.runner import ModelRunner
from engine.weights import Checkpoint, WeightsError


def few_rows(dtype: torch.dtype, batch_invariant: bool) -> int:
    """How many rows each Linear multiplies through the few-row CPU kernel (0: none, torch's way): all it
    takes (64, covering every decode step of the default max_num_seqs; 8 in float32) unless the engine is
    batch-invariant and that is fewer than torch's GEMM keeps invariant."""
    if not cpu_ops.available():
        return 0
    rows = cpu_ops.ops().linear_rows(dtype)
    return rows if rows >= INVARIANT_ROWS or not batch_invariant else 0


def parallelize(model: Transformer, ctx: ParallelContext) -> Transformer:
    cfg = ctx.config
    if cfg.tp > 1:
        shard_for_tp(model, ctx, shard_experts=cfg.ep == 1 and cfg.experts is None)
    if cfg.ep > 1:
        shard_for_ep(model, ctx)
    if cfg.experts is not None:  # TP ranks hold the same tokens: each dispatches a share; CP ranks their own rows
        attach_experts(model, ctx.expert_group, cfg.world_size, share_group=ctx.tp_group)
    return model


def build_runner(checkpoint: Checkpoint, ctx: ParallelContext, *, dtype: torch.dtype, device: str, block_size: int,
                 num_blocks: int, quantization: str = "none", kv_memory=None,
                 batch_invariant: bool = True) -> ModelRunner:
    """This rank's runner: its model (`rank_model`), its KV cache (its KV heads only; in `kv_memory`, see
    `engine.kv_cache.allocate_kv_cache`), and the runner that fits the layout."""
    model = rank_model(checkpoint, ctx, device=device, quantization=quantization)
    if torch.device(device).type == "cpu":
        use_cpu_kernels(model, dtype, quantization, batch_invariant)
    kv_heads = model.layers[0].self_attn.num_kv_heads
    kv_cache = allocate_kv_cache(checkpoint.config, num_blocks, block_size, dtype, device, num_kv_heads=kv_heads,
                                 memory=kv_memory)
    keep_freed_heap()  # from here on a step's buffers reuse freed pages; the KV cache keeps mappings of its own
    if ctx.config.cp > 1:
        return ContextParallelRunner(model, kv_cache, block_size, torch.device(device), ctx)
    return ModelRunner(model, kv_cache, block_size, torch.device(device))


def rank_model(checkpoint: Checkpoint, ctx: ParallelContext, *, device: str, quantization: str = "none") -> Transformer:
    """The model as this rank computes it: built from the checkpoint, quantized (before sharding, so every
    layout computes with the same int8 weights and scales), then sharded for `ctx`."""
    try:
        model = build_model(checkpoint.config, checkpoint.weights, device)
    except (KeyError, RuntimeError) as e:  # a missing tensor, or one whose shape does not fit the config
        raise WeightsError(f"{checkpoint.source}: {e.args[0]}") from None
    if quantization == "int8":
        quantize_int8(model)
    return parallelize(model, ctx)


def use_cpu_kernels(model: Transformer, dtype: torch.dtype, quantization: str, batch_invariant: bool) -> None:
    """Send the model's projections through the CPU kernels where they run (`few_rows`, int8's batch invariance)
    and put its weights in huge pages when a kernel reads them: the few-row and int8 kernels read faster
    there; torch's bf16 `mv` does not, and a start pays 1-2.5 s more for them."""
    rows = few_rows(dtype, batch_invariant)
    for linear in (m for m in model.modules() if isinstance(m, Linear)):
        linear.few_rows = rows
    for linear in (m for m in model.modules() if isinstance(m, Int8Linear)):
        linear.batch_invariant = batch_invariant
    if rows or quantization == "int8":
        to_huge_pages(model)
