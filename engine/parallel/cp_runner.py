"""A model runner for one rank of a context-parallel group.

It runs the same `StepPlan` as every other rank but builds its own flat batch:
all decode rows (replicated: each rank merges the partial attention of all) and,
of each prefill chunk, only the tokens it stores. Its cache holds only its share
of the instance's blocks (`KVStripe`: global block g on rank g % N, as local block
g // N), so which rank stores, computes and attends over a token follows from its
block id alone: no ownership state, no collective to agree on it. It builds the
`CPAttentionMetadata` the ring attention needs, once per step, in local slots.
Pass-KV or pass-Q is chosen per prefill chunk (`ParallelConfig.cp_method`,
"auto" = the paper's heuristic) and recorded in `choices`. The sampled rows are summed over the group (only their owner
contributes), and rank 0 computes the logits.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from engine.kv_cache import KVCache, KVStripe
from engine.model import Transformer
from engine.parallel.context import ParallelContext
from engine.parallel.cp_attention import CPAttentionMetadata, CPSpan, context_parallel_attention
from engine.parallel.cp_choice import CPChoice, CPMethod, choose_cp_method
from engine.parallel.cp_shard import Run, kv_segments, query_segments, stored_positions, stripe_runs
from engine.runner import ModelRunner, after_each_layer
from engine.step_plan import ChunkPlan, StepPlan


class ContextParallelRunner(ModelRunner):
    def __init__(self, model: Transformer, kv_cache: KVCache, block_size: int, device: torch.device,
                 ctx: ParallelContext) -> None:
        super().__init__(model, kv_cache, block_size, device)
        self.group, self.rank, self.cp_size = ctx.cp_group, ctx.cp_rank, ctx.config.cp
        self.parallel = ctx.config
        self.kv_stripe = KVStripe(self.rank, self.cp_size)
        self.choices: Counter[CPMethod] = Counter()  # prefill chunks run by each method
        self.last_choices: list[CPChoice] = []
        for layer in model.layers:
            layer.self_attn.attend = context_parallel_attention

    @torch.inference_mode()
    def execute(self, plan: StepPlan, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        bs, dev = self.block_size, self.device
        token_ids: list[int] = []
        positions: list[int] = []
        write_rows: list[int] = []
        write_slots: list[torch.Tensor] = []
        decode_rows, spans = [], []
        sample_rows: list[int | None] = []  # local row of each sampled token, None when another rank holds it
        self.last_choices = []
        for chunk in plan.chunks:
            table = chunk.block_table
            first_row = len(token_ids)
            slots = self._stored_slots(table, chunk.start, chunk.end)  # of the new tokens stored here, in order
            write_slots.append(slots)
            if chunk.num_tokens == 1:
                offsets = [0]
                write_rows += [first_row] * len(slots)  # none, or this row when its token is stored here
                decode_rows.append((table, chunk.end))
                last_row = first_row if self.rank == 0 else None
            else:
                runs = stripe_runs(table, chunk.start, chunk.end, bs, self.cp_size)
                mine = runs[self.rank]
                offsets = [p - chunk.start for start, end in mine for p in range(start, end)]
                write_rows += range(first_row, first_row + len(offsets))  # this rank's rows are the stored tokens
                spans.append(self._span(chunk, runs, slice(first_row, first_row + len(offsets))))
                last_row = first_row + len(offsets) - 1 if mine and mine[-1][1] == chunk.end else None
            token_ids += [chunk.token_ids[t] for t in offsets]
            positions += [chunk.start + t for t in offsets]
            if chunk.samples:
                sample_rows.append(last_row)
        tables, mask = self._decode_view(decode_rows) if decode_rows else (None, None)
        meta = CPAttentionMetadata(
            group=self.group,
            write_rows=torch.tensor(write_rows, dtype=torch.long, device=dev),
            write_slots=torch.cat(write_slots).to(dev),
            num_decode=len(decode_rows),
            decode_block_tables=tables,
            decode_mask=mask,
            spans=tuple(spans),
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        with after_each_layer(self.model, on_layer):
            hidden = self.model(ids, pos, self.kv_cache, meta)  # [T_local, D]
        sampled = hidden.new_zeros((len(sample_rows), hidden.shape[1]))  # [S, D]
        for i, row in enumerate(sample_rows):
            if row is not None:
                sampled[i] = hidden[row]
        self.group.allreduce([sampled]).wait()  # one rank holds each row; the others add zeros
        if self.rank != 0:
            return sampled[:0]  # only rank 0 samples
        return self.model.compute_logits(sampled)  # [S, V]

    def _stored_slots(self, table: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        """This rank's cache slots of the positions in [start, end) it stores, in position order."""
        bs = self.block_size
        positions = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[positions // bs]  # [end - start] global block ids
        kept = blocks % self.cp_size == self.rank
        return blocks[kept] // self.cp_size * bs + positions[kept] % bs

    def _decode_view(self, rows: list[tuple[tuple[int, ...], int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per decode row (block table, context length): the blocks stored here, as local ids padded to one
        width, and the mask of their tokens in context -> tables [B, W], mask [B, 1, 1, W * block_size]."""
        bs, stripe = self.block_size, self.kv_stripe
        held = [[(i, stripe.local(b)) for i, b in enumerate(table[: -(-length // bs)]) if stripe.stores(b)]
                for table, length in rows]
        width = max(1, max(len(h) for h in held))
        tables = torch.zeros((len(rows), width), dtype=torch.long)
        filled = torch.zeros((len(rows), width), dtype=torch.long)  # tokens in context in each held block
        for r, (blocks, (_, length)) in enumerate(zip(held, rows)):
            for j, (i, local) in enumerate(blocks):
                tables[r, j], filled[r, j] = local, min(bs, length - i * bs)
        mask = torch.arange(bs)[None, None, :] < filled[:, :, None]  # [B, W, bs]
        return tables.to(self.device), mask.flatten(1)[:, None, None, :].to(self.device)

    def _span(self, chunk: ChunkPlan, runs: list[list[Run]], rows: slice) -> CPSpan:
        queries = tuple(query_segments(r) for r in runs)
        cached = [stored_positions(chunk.block_table, chunk.start, self.block_size, KVStripe(rank, self.cp_size))
                  for rank in range(self.cp_size)]
        keys = tuple(kv_segments(c, q) for c, q in zip(cached, queries))
        choice = self._choose(chunk)
        self.choices[choice.method] += 1
        self.last_choices.append(choice)
        return CPSpan(rows=rows, cached_slots=self._stored_slots(chunk.block_table, 0, chunk.start).to(self.device),
                      choice=choice, query_layouts=queries, kv_layouts=keys,
                      kv_len=max(k[-1].end if k else 0 for k in keys),
                      q_len=max(q[-1].end if q else 0 for q in queries))

    def _choose(self, chunk: ChunkPlan) -> CPChoice:
        forced = self.parallel.cp_method
        if forced != "auto":
            return CPChoice(method=CPMethod(forced), reason=f"forced by cp_method={forced}")
        cfg = self.model.config
        return choose_cp_method(new_tokens=chunk.num_tokens, cached_tokens=chunk.start, cp_size=self.cp_size,
                                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                peak_flops=self.parallel.cp_peak_flops, bandwidth=self.parallel.cp_bandwidth,
                                bytes_per_element=self.kv_cache[0][0].element_size())
