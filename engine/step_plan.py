"""What one engine step computes, as plain data: the message rank 0 broadcasts to its followers.

A `StepPlan` is built from the scheduler's chunks and holds everything a rank
needs to run the model for that step (token ids, positions, KV block tables,
which rows are sampled) and nothing it does not (no sequences, no sampling
parameters). Single-token chunks come first, in a stable order, so that decode
rows share one batched attention call; the logits the runner returns follow
`sampling_indices`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler import ScheduledChunk


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    token_ids: tuple[int, ...]  # the chunk's tokens
    start: int  # position of the first one (= tokens of the sequence already in the cache)
    block_table: tuple[int, ...]  # the sequence's KV blocks
    samples: bool  # a token is drawn from the chunk's last row

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    chunks: tuple[ChunkPlan, ...]  # decodes (one token) first
    # KV reservations that ended since the last step (joined, recomputed or cancelled): ranks that accept
    # pushed KV stop writing into their blocks before this step may reuse them.
    ended_reservations: tuple[str, ...] = ()
    # (chunk index, request id) of chunks that complete a prompt whose KV is pushed out layer by layer
    # (each rank of a context-parallel prefill instance pushes the tokens it stores).
    pushes: tuple[tuple[int, str], ...] = ()

    @property
    def sampling_indices(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.chunks) if c.samples)


def plan_step(chunks: list[ScheduledChunk], block_size: int, ended_reservations: tuple[str, ...] = (),
              pushed: frozenset[str] = frozenset()) -> tuple[StepPlan, list[ScheduledChunk]]:
    """The plan, and the scheduled chunks in plan order (to match logits rows back to sequences).
    `pushed`: requests whose prompt KV goes to a sink once their prompt completes."""
    ordered = sorted(chunks, key=lambda c: c.num_tokens > 1)  # stable: decodes first
    plan = StepPlan(tuple(
        ChunkPlan(tuple(c.seq.token_ids[c.start:c.end]), c.start, tuple(c.seq.block_table[: -(-c.end // block_size)]),
                  c.samples)
        for c in ordered
    ), ended_reservations, tuple(
        (i, c.seq.request_id) for i, c in enumerate(ordered)
        if c.seq.request_id in pushed and c.end == c.seq.num_prompt_tokens
    ))
    return plan, ordered
