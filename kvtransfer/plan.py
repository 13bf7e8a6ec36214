"""Which bytes go where: a pure plan from the prefill layout of a request's KV to the decode layout.

The prefill instance is context-parallel: each CP rank holds some of the
request's tokens (load-balanced chunks, plus whatever part of a cached prefix it
stores), with every KV head, in blocks of its block size, addressed by one block
table shared by its ranks. The decode instance is tensor-parallel: each TP rank
stores every token of the request but only its range of KV heads (ranges overlap
where a KV head is replicated), in blocks of its own block size. Tokens below
`DecodeLayout.first_token` are already on decode (its own cached prefix).

`plan(src, dst)` returns the pieces: for each destination rank, each source
rank's tokens cut wherever either side's slots stop being consecutive (a block
ends and the table's next block is not the one after it), so that every piece
is a run of consecutive slots on both sides, as long as the tables allow,
carrying the destination's head range.
The same pieces apply to every layer (transports push layer by layer). Every
(destination rank, token, head of that rank) is covered exactly once.

Slots: a token at position p lives in slot `table[p // block_size] * block_size
+ p % block_size` of a cache viewed as [blocks * block_size, heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillLayout:
    token_ranges: tuple[tuple[tuple[int, int], ...], ...]  # per CP rank: disjoint [start, end) positions it holds
    num_kv_heads: int  # every CP rank holds all KV heads
    block_size: int
    block_table: tuple[int, ...]  # the request's blocks, the same on every CP rank

    def __post_init__(self) -> None:
        _check_blocks("prefill", self.block_size, self.block_table, self.num_tokens)
        spans = sorted(r for ranges in self.token_ranges for r in ranges if r[1] > r[0])
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])) or (spans and spans[0][0] < 0):
            raise ValueError(f"prefill token ranges must be disjoint and non-negative, got {self.token_ranges}")

    @property
    def num_tokens(self) -> int:
        return max((end for ranges in self.token_ranges for _, end in ranges), default=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeLayout:
    head_ranges: tuple[tuple[int, int], ...]  # per TP rank: [start, end) of the global KV heads it stores
    block_size: int
    block_table: tuple[int, ...]  # the blocks reserved for the request, the same on every TP rank
    first_token: int = 0  # tokens before this are already cached on decode

    def __post_init__(self) -> None:
        if not self.head_ranges or any(end <= start or start < 0 for start, end in self.head_ranges):
            raise ValueError(f"every decode rank needs a non-empty head range, got {self.head_ranges}")


@dataclass(frozen=True, slots=True)
class Piece:
    src_rank: int
    dst_rank: int
    tokens: tuple[int, int]  # [start, end) positions
    heads: tuple[int, int]  # [start, end) global KV heads (the destination rank's range)
    src_slot: int  # first slot on the source rank; the piece is consecutive slots from there
    dst_slot: int  # first slot on the destination rank, which stores `heads` as its heads 0..n-1

    @property
    def num_tokens(self) -> int:
        return self.tokens[1] - self.tokens[0]


def plan(src: PrefillLayout, dst: DecodeLayout) -> tuple[Piece, ...]:
    num_tokens = src.num_tokens
    _check_blocks("decode", dst.block_size, dst.block_table, num_tokens)
    if max(end for _, end in dst.head_ranges) > src.num_kv_heads:
        raise ValueError(f"decode head ranges {dst.head_ranges} exceed the {src.num_kv_heads} KV heads of prefill")
    runs = []  # (source rank, [start, stop) positions): consecutive slots on both sides
    for src_rank, ranges in enumerate(src.token_ranges):
        for start, end in ranges:
            start = max(start, dst.first_token)
            while start < end:
                stop = min(_consecutive_end(start, end, src.block_table, src.block_size),
                           _consecutive_end(start, end, dst.block_table, dst.block_size))
                runs.append((src_rank, start, stop))
                start = stop
    return tuple(Piece(src_rank, dst_rank, (start, stop), heads, _slot(start, src.block_table, src.block_size),
                       _slot(start, dst.block_table, dst.block_size))
                 for dst_rank, heads in enumerate(dst.head_ranges) for src_rank, start, stop in runs)


def _consecutive_end(position: int, end: int, table: tuple[int, ...], block_size: int) -> int:
    """Where the slots of positions from `position` stop being consecutive, at most `end`."""
    block, last = position // block_size, (end - 1) // block_size
    while block < last and table[block + 1] == table[block] + 1:
        block += 1
    return min(end, (block + 1) * block_size)


def _slot(position: int, table: tuple[int, ...], block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


def _check_blocks(side: str, block_size: int, table: tuple[int, ...], num_tokens: int) -> None:
    if block_size < 1:
        raise ValueError(f"{side} block_size must be >= 1, got {block_size}")
    if len(table) * block_size < num_tokens:
        raise ValueError(f"{side} block table has {len(table)} blocks of {block_size} "
                         f"({len(table) * block_size} slots) for {num_tokens} tokens")
