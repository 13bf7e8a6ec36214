"""Which new tokens of a prefill chunk each context-parallel rank computes, and how its blocks are laid out.

A rank computes the tokens it stores: those whose block its `KVStripe` holds. The
block manager lays a prompt's blocks out zigzag over the ranks (2N groups, rank i
taking groups i and 2N-1-i), so every rank gets an early (cheap) and a late
(expensive) part of causal attention; a chunk that starts inside a block owned
by one rank gives that rank the rest of the block too. So a rank's tokens are a
few runs of consecutive positions (`Run`s), disjoint from every other rank's.

In a rank's query block its runs follow each other in position order; its KV
block is the cached prefix it stores, then the same runs. A run is named by its
first position, which orders runs across ranks: a query run sees an earlier run
(and the cached prefix) whole, its own run causally, and a later run not at all.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from engine.kv_cache import KVStripe

Run = tuple[int, int]  # [start, end) positions


def stripe_runs(block_table: Sequence[int], start: int, end: int, block_size: int,
                cp_size: int) -> list[list[Run]]:
    """Per rank: the runs of positions in [start, end) whose blocks that rank stores."""
    runs: list[list[Run]] = [[] for _ in range(cp_size)]
    position = start
    while position < end:
        stop = min(end, (position // block_size + 1) * block_size)
        rank = block_table[position // block_size] % cp_size
        mine = runs[rank]
        if mine and mine[-1][1] == position:
            mine[-1] = (mine[-1][0], stop)
        else:
            mine.append((position, stop))
        position = stop
    return runs


def stored_positions(block_table: Sequence[int], num_tokens: int, block_size: int, stripe: KVStripe) -> int:
    """How many of the first `num_tokens` positions `stripe` stores."""
    full, rest = divmod(num_tokens, block_size)
    count = sum(block_size for block in block_table[:full] if stripe.stores(block))
    return count + (rest if rest and stripe.stores(block_table[full]) else 0)


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows [start, end) of a rank's query or KV block that hold one run (or the cached prefix)."""

    run: int | None  # the run's first position; None for the cached prefix, before every new token
    start: int
    end: int


class Visibility(enum.Enum):
    """How a query run sees a key run under causal attention."""

    WHOLE = "whole"  # every key precedes every query
    CAUSAL = "causal"  # the same run: key j is visible to query i when j <= i


def query_segments(runs: Sequence[Run]) -> tuple[Segment, ...]:
    """A rank's new tokens in block order: its runs, one after the other."""
    segments, row = [], 0
    for start, end in runs:
        segments.append(Segment(start, row, row + end - start))
        row += end - start
    return tuple(segments)


def kv_segments(num_cached: int, queries: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """A rank's KV block: the cached prefix it holds, then its new tokens."""
    cached = (Segment(None, 0, num_cached),) if num_cached else ()
    return cached + tuple(Segment(s.run, s.start + num_cached, s.end + num_cached) for s in queries)


def sees(query_run: int, key_run: int | None) -> Visibility | None:
    """How a query run sees a key run (None: the cached prefix); None when it does not see it at all."""
    if key_run is None or key_run < query_run:
        return Visibility.WHOLE
    return Visibility.CAUSAL if key_run == query_run else None
