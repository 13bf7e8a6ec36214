"""Continuous batching under a token budget. Pure Python: no torch.

Each `schedule()` builds one step: first every running sequence gets its next
chunk (one token when decoding, up to the remaining budget while its prompt is
still being prefilled), then waiting sequences are admitted oldest first while
budget, sequence slots and KV blocks allow. Admission reuses the longest cached
prefix. When a running sequence needs a block and none is free, the newest
running sequence not yet in this step is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed (prompt and the tokens it
already produced) when there is room.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token of the chunk (= tokens already in the cache)
    num_tokens: int
    samples: bool  # the chunk reaches the sequence's last known token, so a new token is drawn

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> "ScheduledChunk":
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config, self.blocks = config, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        in_step: set[int] = set()
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.grow(seq.block_table, seq.num_computed_tokens + n):
                victim = max((s for s in self.running if id(s) not in in_step), key=lambda s: s.arrival)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chunks.append(ScheduledChunk.of(seq, n))
                in_step.add(id(seq))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            blocks, hashes = self.blocks.match_prefix(seq.token_ids)
            n = min(seq.num_tokens - len(blocks) * self.blocks.block_size, budget)
            if not self.blocks.grow(blocks, len(blocks) * self.blocks.block_size + n):
                self.blocks.free(blocks)
                break
            self.waiting.popleft()
            seq.block_table, seq.block_hashes = blocks, hashes
            seq.num_computed_tokens = len(hashes) * self.blocks.block_size
            seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk.of(seq, n))
            budget -= n
        return chunks

    def reserve(self, seq: Sequence) -> bool:
        """Hold KV blocks for the whole prompt of `seq` (reusing a cached prefix), without scheduling it."""
        blocks, hashes = self.blocks.match_prefix(seq.prompt_token_ids)
        if not self.blocks.grow(blocks, seq.num_prompt_tokens):
            self.blocks.free(blocks)
            return False
        seq.block_table, seq.block_hashes = blocks, hashes
        seq.num_cached_prompt_tokens = min(len(hashes) * self.blocks.block_size, seq.num_prompt_tokens)
        seq.status = SequenceStatus.RESERVED
        return True

    def join(self, seq: Sequence) -> None:
        """A reserved sequence whose prompt KV has arrived: it decodes from its next step on."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.blocks.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens, seq.block_hashes)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def update(self, chunks: list[ScheduledChunk]) -> None:
        """After the step ran: the chunks' KV is in the cache."""
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            self.blocks.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens, seq.block_hashes)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Also for reserved sequences: their blocks are freed the same way."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
