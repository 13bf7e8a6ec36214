"""A model runner for one rank of a context-parallel group.

It runs the same `StepPlan` as every other rank but builds its own flat batch:
all decode rows (replicated: each rank merges the partial attention of all) and,
of each prefill chunk, only its load-balanced shard (`shard_tokens`). It decides
who stores each new token's KV (prefill: the shard's rank; decode: position mod
N), keeps which cache slots it owns, and builds the `CPAttentionMetadata` the
ring attention needs, once per step. Pass-KV or pass-Q is chosen per prefill
chunk (`ParallelConfig.cp_method`, "auto" = the paper's heuristic) and recorded
in `choices`. The sampled rows are summed over the group (only their owner
contributes), and rank 0 computes the logits.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from engine.kv_cache import KVCache
from engine.model import Transformer
from engine.parallel.context import ParallelContext
from engine.parallel.cp_attention import CPAttentionMetadata, CPSpan, context_parallel_attention
from engine.parallel.cp_choice import CPChoice, CPMethod, choose_cp_method
from engine.parallel.cp_shard import kv_segments, query_segments, shard_tokens
from engine.runner import ModelRunner, after_each_layer
from engine.step_plan import ChunkPlan, StepPlan


class ContextParallelRunner(ModelRunner):
    def __init__(self, model: Transformer, kv_cache: KVCache, block_size: int, device: torch.device,
                 ctx: ParallelContext) -> None:
        super().__init__(model, kv_cache, block_size, device)
        self.group, self.rank, self.cp_size = ctx.cp_group, ctx.cp_rank, ctx.config.cp
        self.parallel = ctx.config
        self.owned = torch.zeros(kv_cache[0][0].shape[0] * block_size, dtype=torch.bool, device=device)
        self.choices: Counter[CPMethod] = Counter()  # prefill chunks run by each method
        self.last_choices: list[CPChoice] = []
        for layer in model.layers:
            layer.self_attn.attend = context_parallel_attention

    @property
    def stored_slots(self) -> torch.Tensor:
        return self.owned

    @torch.inference_mode()
    def execute(self, plan: StepPlan, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        self._record_ownership(plan)
        bs, dev = self.block_size, self.device
        token_ids: list[int] = []
        positions: list[int] = []
        write_rows, write_slots = [], []
        decode_tables, decode_lens, spans = [], [], []
        sample_rows: list[int | None] = []  # local row of each sampled token, None when another rank holds it
        self.last_choices = []
        for chunk in plan.chunks:
            table = chunk.block_table
            first_row = len(token_ids)
            if chunk.num_tokens == 1:
                offsets = [0]
                if chunk.start % self.cp_size == self.rank:
                    write_rows.append(first_row)
                    write_slots.append(table[chunk.start // bs] * bs + chunk.start % bs)
                decode_tables.append(list(table))
                decode_lens.append(chunk.end)
                last_row = first_row if self.rank == 0 else None
            else:
                shard = shard_tokens(chunk.num_tokens, self.cp_size)[self.rank]
                offsets = [t for start, end in shard.ranges for t in range(start, end)]
                write_rows += range(first_row, first_row + len(offsets))
                write_slots += [table[p // bs] * bs + p % bs for p in shard.positions(chunk.start)]
                spans.append(self._span(chunk, slice(first_row, first_row + len(offsets))))
                last = chunk.num_tokens - 1
                last_row = first_row + offsets.index(last) if last in offsets else None
            token_ids += [chunk.token_ids[t] for t in offsets]
            positions += [chunk.start + t for t in offsets]
            if chunk.samples:
                sample_rows.append(last_row)
        tables = self._padded_tables(decode_tables)
        meta = CPAttentionMetadata(
            group=self.group,
            write_rows=torch.tensor(write_rows, dtype=torch.long, device=dev),
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=dev),
            num_decode=len(decode_tables),
            decode_block_tables=tables,
            decode_mask=None if tables is None else self._decode_mask(tables, decode_lens),
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

    def _record_ownership(self, plan: StepPlan) -> None:
        """Mark the slots of this step's new tokens as owned here or elsewhere (before any layer writes)."""
        bs, slots, mine = self.block_size, [], []
        for chunk in plan.chunks:
            slots += [chunk.block_table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end)]
            if chunk.num_tokens == 1:
                mine.append(chunk.start % self.cp_size == self.rank)
            else:
                held = set(shard_tokens(chunk.num_tokens, self.cp_size)[self.rank].positions())
                mine += [t in held for t in range(chunk.num_tokens)]
        self.owned[torch.tensor(slots, dtype=torch.long)] = torch.tensor(mine, dtype=torch.bool)

    def _padded_tables(self, tables: list[list[int]]) -> torch.Tensor | None:
        if not tables:
            return None
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device)

    def _decode_mask(self, tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
        bs = self.block_size
        slots = (tables[:, :, None] * bs + torch.arange(bs, device=self.device)).flatten(1)  # [B, L]
        in_context = torch.arange(slots.shape[1], device=self.device)[None, :] < torch.tensor(lens)[:, None]
        return (in_context & self.owned[slots])[:, None, None, :]  # [B, 1, 1, L]

    def _span(self, chunk: ChunkPlan, rows: slice) -> CPSpan:
        bs, dev = self.block_size, self.device
        prefix = torch.arange(chunk.start, device=dev)
        table = torch.tensor(chunk.block_table, dtype=torch.long, device=dev)
        prefix_slots = table[prefix // bs] * bs + prefix % bs  # [start]
        cached_slots = prefix_slots[self.owned[prefix_slots]]  # [c]: the part of the prefix stored here
        queries = tuple(query_segments(shard) for shard in shard_tokens(chunk.num_tokens, self.cp_size))
        cached_counts = torch.empty(self.cp_size, dtype=torch.long)
        self.group._allgather_base(cached_counts, torch.tensor([len(cached_slots)])).wait()
        keys = tuple(kv_segments(int(c), q) for c, q in zip(cached_counts, queries))
        choice = self._choose(chunk)
        self.choices[choice.method] += 1
        self.last_choices.append(choice)
        return CPSpan(rows=rows, cached_slots=cached_slots, choice=choice, query_layouts=queries, kv_layouts=keys,
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
