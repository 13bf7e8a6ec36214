"""Runs one scheduled step through the model: flat inputs in, logits of the sampled rows out.

Single-token chunks (decode steps) go first in the flat batch and share one batched
attention call; multi-token chunks (prefill) follow, one span each. Logits are
computed only for the last token of each chunk that reaches its sequence's end.
"""

from __future__ import annotations

import torch

from engine.attention import build_metadata
from engine.kv_cache import KVCache
from engine.model import Transformer
from engine.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: Transformer, kv_cache: KVCache, block_size: int, device: torch.device) -> None:
        self.model, self.kv_cache, self.block_size, self.device = model, kv_cache, block_size, device

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Returns the sampling chunks and their logits [len(sampling), V] (float32), in the same order."""
        ordered = sorted(chunks, key=lambda c: c.num_tokens > 1)  # stable: decodes first
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables, decode_lens, prefill_chunks = [], [], []
        sample_rows, sampling = [], []
        bs = self.block_size
        for chunk in ordered:
            seq = chunk.seq
            token_ids += seq.token_ids[chunk.start:chunk.end]
            positions += range(chunk.start, chunk.end)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end)]
            if chunk.num_tokens == 1:
                decode_tables.append(seq.block_table[: -(-chunk.end // bs)])
                decode_lens.append(chunk.end)
            else:
                prefill_chunks.append((chunk.num_tokens, chunk.end, seq.block_table))
            if chunk.samples:
                sample_rows.append(len(token_ids) - 1)
                sampling.append(chunk)
        meta = build_metadata(slot_mapping=slots, decode_block_tables=decode_tables, decode_context_lens=decode_lens,
                              prefill_chunks=prefill_chunks, block_size=bs, device=self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache, meta)  # [T, D]
        if not sample_rows:
            return [], hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        rows = torch.tensor(sample_rows, device=self.device)
        return sampling, self.model.compute_logits(hidden[rows])
