"""Load-balanced context-parallel sharding of a prompt's new tokens.

The T new tokens are cut into 2N equal chunks (the last ones may be short or
empty); rank i takes chunks i and 2N-1-i, so every rank gets one early (cheap)
and one late (expensive) chunk of causal attention. Every rank's message is
padded to the same length (2 * chunk), as pass-KV sends equal-sized blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CPShard:
    rank: int
    cp_size: int
    ranges: tuple[tuple[int, int], tuple[int, int]]  # [start, end) of its two chunks, in token order
    padded_len: int  # tokens per rank after padding, equal on every rank

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self.ranges)

    def positions(self, offset: int = 0) -> list[int]:
        """Absolute positions of this rank's tokens (offset = cached prefix length)."""
        return [offset + p for start, end in self.ranges for p in range(start, end)]


def shard_tokens(num_tokens: int, cp_size: int) -> list[CPShard]:
    if num_tokens < 1 or cp_size < 1:
        raise ValueError(f"num_tokens and cp_size must be >= 1, got {num_tokens} and {cp_size}")
    chunk = -(-num_tokens // (2 * cp_size))

    def chunk_range(j: int) -> tuple[int, int]:
        return min(j * chunk, num_tokens), min((j + 1) * chunk, num_tokens)

    return [CPShard(i, cp_size, (chunk_range(i), chunk_range(2 * cp_size - 1 - i)), 2 * chunk) for i in range(cp_size)]


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows [start, end) of a rank's query or KV block that hold one chunk (or the cached prefix)."""

    chunk: int | None  # the chunk's index among the 2N; None for the cached prefix, before every new token
    start: int
    end: int


class Visibility(enum.Enum):
    """How a query chunk sees a key chunk under causal attention."""

    WHOLE = "whole"  # every key precedes every query
    CAUSAL = "causal"  # the same chunk: key j is visible to query i when j <= i


def query_segments(shard: CPShard) -> tuple[Segment, ...]:
    """The rank's new tokens in block order: its early chunk, then its late one (empty chunks left out)."""
    segments, row = [], 0
    chunks = (shard.rank, 2 * shard.cp_size - 1 - shard.rank)
    for chunk, (start, end) in zip(chunks, shard.ranges):
        if end > start:
            segments.append(Segment(chunk, row, row + end - start))
            row += end - start
    return tuple(segments)


def kv_segments(num_cached: int, queries: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """A rank's KV block: the cached prefix it holds, then its new tokens."""
    cached = (Segment(None, 0, num_cached),) if num_cached else ()
    return cached + tuple(Segment(s.chunk, s.start + num_cached, s.end + num_cached) for s in queries)


def sees(query_chunk: int, key_chunk: int | None) -> Visibility | None:
    """How a query chunk sees a key chunk (None: the cached prefix); None when it does not see it at all."""
    if key_chunk is None or key_chunk < query_chunk:
        return Visibility.WHOLE
    return Visibility.CAUSAL if key_chunk == query_chunk else None
