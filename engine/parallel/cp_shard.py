"""Load-balanced context-parallel sharding of a prompt's new tokens.

The T new tokens are cut into 2N equal chunks (the last ones may be short or
empty); rank i takes chunks i and 2N-1-i, so every rank gets one early (cheap)
and one late (expensive) chunk of causal attention. Every rank's message is
padded to the same length (2 * chunk), as pass-KV sends equal-sized blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CPShard:
    rank: int
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

    return [CPShard(i, (chunk_range(i), chunk_range(2 * cp_size - 1 - i)), 2 * chunk) for i in range(cp_size)]
