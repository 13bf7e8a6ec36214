"""What one engine step computes, as plain data: the message rank 0 broadcasts to its followers.

A `StepPlan` is built from the scheduler's chunks and holds everything a rank
needs to run the model for that step (token ids, positions, KV block tables,
which rows are sampled) and nothing it does not (no sequences, no sampling
parameters). Single-token chunks come first, in a stable order, so that decode
rows share one batched attention call; the logits the runner returns follow
`sampling_indices`.

A plan crosses to the other ranks every step, so it has a wire form of its own (`encode` / `decode`:
a version, then int32 words, then the request ids as UTF-8), several times faster than a generic codec
and than pickle; every other message between ranks goes through `engine.parallel.control`.
"""

from __future__ import annotations

from array import array
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


WIRE_VERSION = 1


def encode(plan: StepPlan) -> bytes:
    """int32 words: [version, word count, chunks, ended, pushes], per chunk [start, samples, tokens, blocks,
    *token_ids, *block_table], per push its chunk index; then the ended and pushed request ids, NUL-separated."""
    words = [WIRE_VERSION, 0, len(plan.chunks), len(plan.ended_reservations), len(plan.pushes)]
    for c in plan.chunks:
        words += (c.start, c.samples, len(c.token_ids), len(c.block_table))
        words += c.token_ids
        words += c.block_table
    words += (index for index, _ in plan.pushes)
    words[1] = len(words)
    ids = "\0".join([*plan.ended_reservations, *(request_id for _, request_id in plan.pushes)])
    return array("i", words).tobytes() + ids.encode()


def decode(payload: bytes) -> StepPlan:
    header = array("i", payload[:20])
    if header[0] != WIRE_VERSION:
        raise ValueError(f"step plan wire version {header[0]}, expected {WIRE_VERSION}")
    _, size, num_chunks, num_ended, num_pushes = header
    words = array("i", payload[: 4 * size])
    chunks, at = [], 5
    for _ in range(num_chunks):
        start, samples, tokens, blocks = words[at: at + 4]
        at += 4
        chunks.append(ChunkPlan(tuple(words[at: at + tokens]), start, tuple(words[at + tokens: at + tokens + blocks]),
                                bool(samples)))
        at += tokens + blocks
    ids = payload[4 * size:].decode().split("\0") if num_ended + num_pushes else []
    return StepPlan(tuple(chunks), tuple(ids[:num_ended]), tuple(zip(words[at: size], ids[num_ended:], strict=True)))
