"""Runs one step plan through the model: flat inputs in, logits of the sampled rows out.

Single-token chunks (decode steps) come first in the flat batch and share one
batched attention call; multi-token chunks (prefill) follow, one span each.
Logits are computed only for the last row of each chunk that samples.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from engine.attention import build_metadata
from engine.kernels import cpu_ops
from engine.kv_cache import KVCache, KVStripe
from engine.model import Transformer
from engine.step_plan import StepPlan


class ModelRunner:
    kv_stripe = KVStripe()  # which of the instance's blocks this rank's cache holds: all of them

    def __init__(self, model: Transformer, kv_cache: KVCache, block_size: int, device: torch.device) -> None:
        self.model, self.kv_cache, self.block_size, self.device = model, kv_cache, block_size, device
        if device.type == "cpu":
            cpu_ops.available()  # built (or found built) now, not in the first decode step
        self.last_choices: list = []  # pass-KV/pass-Q choice per prefill chunk of the last step (context parallel)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [len(plan.sampling_indices), V] (float32), in plan order. `on_layer(i)` runs as each
        layer finishes (its KV for this step is then in the cache)."""
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables, decode_lens, prefill_chunks = [], [], []
        sample_rows = []
        bs = self.block_size
        for chunk in plan.chunks:
            table = chunk.block_table
            token_ids += chunk.token_ids
            positions += range(chunk.start, chunk.end)
            slots += [table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end)]
            if chunk.num_tokens == 1:
                decode_tables.append(list(table))
                decode_lens.append(chunk.end)
            else:
                prefill_chunks.append((chunk.num_tokens, chunk.end, list(table)))
            if chunk.samples:
                sample_rows.append(len(token_ids) - 1)
        meta = build_metadata(slot_mapping=slots, decode_block_tables=decode_tables, decode_context_lens=decode_lens,
                              prefill_chunks=prefill_chunks, block_size=bs, device=self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        with after_each_layer(self.model, on_layer):
            hidden = self.model(ids, pos, self.kv_cache, meta)  # [T, D]
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])  # [S, V]


@contextlib.contextmanager
def after_each_layer(model: Transformer, on_layer: Callable[[int], None] | None):
    if on_layer is None:
        yield
        return
    hooks = [layer.register_forward_hook(lambda *_, i=i: on_layer(i)) for i, layer in enumerate(model.layers)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
