"""KV block accounting with prefix caching. Pure Python: no torch.

Blocks hold `block_size` tokens. A sequence's block table is a plain list of block
ids owned by the caller; this class keeps reference counts and the prefix cache.

Prefix cache: every full block whose tokens are computed gets a hash that chains
the previous block's hash with its own token ids (`block_hash`), so a hash names a
whole prefix. A new prompt reuses the longest run of cached blocks that matches
its own chain. Blocks whose reference count drops to 0 are free but keep their
contents and hash until reused: allocation takes the least recently freed block
first (LRU eviction), so recently used prefixes survive longest.

Hashes are stable across processes (blake2b), so the registry can publish them.

Pools: the blocks of a context-parallel instance of N ranks come in N pools, block
g in pool g % N (the rank that stores it, `engine.kv_cache.KVStripe`). Where the
new blocks of one `grow` go is `place_blocks`: a run of at least 2N blocks (a
prompt) is laid out zigzag over the pools, so every rank computes an early and a
late part of it and causal attention is balanced; fewer blocks (a decode step, a
short prompt) go to the pools with the most free blocks, so memory stays
balanced. A pool that is full sends its share to the others; allocation fails
only when all of them together are short.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Sequence


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first)."""
    h = hashlib.blake2b((parent or 0).to_bytes(8, "little"), digest_size=8)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))  # int32 little-endian, one C call a block
    return int.from_bytes(h.digest(), "little")


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of every full block of `token_ids`."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


def place_blocks(num_new: int, free: Sequence[int]) -> list[int] | None:
    """The pool of each of `num_new` new blocks of one sequence, given each pool's free blocks; None if short."""
    pools = len(free)
    if num_new > sum(free):
        return None
    if pools > 1 and num_new >= 2 * pools:  # zigzag: 2N groups, group j to pool min(j, 2N-1-j)
        group = -(-num_new // (2 * pools))
        wanted: list[int | None] = [min(j, 2 * pools - 1 - j) for j in (i // group for i in range(num_new))]
    else:
        wanted = [None] * num_new
    left, placed = list(free), []
    for pool in wanted:
        if pool is None or left[pool] == 0:
            pool = max(range(pools), key=left.__getitem__)  # the most free; ties: the lowest
        left[pool] -= 1
        placed.append(pool)
    return placed


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, pools: int = 1) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks} and {block_size}")
        if pools < 1 or num_blocks % pools:
            raise ValueError(f"num_blocks={num_blocks} must be a multiple of pools={pools}")
        self.num_blocks, self.block_size, self.pools = num_blocks, block_size, pools
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_lru: list[OrderedDict[int, None]] = [  # per pool, least recently freed first
            OrderedDict((b, None) for b in range(pool, num_blocks, pools)) for pool in range(pools)]

    @property
    def num_free_blocks(self) -> int:
        return sum(len(free) for free in self.free_lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def used_blocks_per_pool(self) -> list[int]:
        return [self.num_blocks // self.pools - len(free) for free in self.free_lru]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Take a reference on the longest cached prefix of `token_ids`: (blocks, their chain hashes).

        At least the last token is left uncached, so that the caller computes it and
        has logits to sample from.
        """
        blocks: list[int] = []
        hashes: list[int] = []
        usable = (len(token_ids) - 1) // self.block_size
        for h in prefix_hashes(token_ids[: usable * self.block_size], self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
        for block in blocks:
            self._acquire(block)
        return blocks, hashes

    def cache_full_blocks(self, block_table: Sequence[int], token_ids: Sequence[int],
                          num_computed: int, chain: list[int]) -> None:
        """Publish blocks that became full and computed; `chain` (the sequence's block
        hashes so far) grows by one hash per newly full block."""
        full, start = min(num_computed // self.block_size, len(block_table)), len(chain)
        if start >= full:
            return  # most steps: no block became full
        for i in range(start, full):
            chain.append(block_hash(chain[-1] if chain else None,
                                    token_ids[i * self.block_size:(i + 1) * self.block_size]))
        self.adopt(block_table[start:full], chain[start:full])

    def adopt(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Publish full, computed `blocks` (or filled from elsewhere: a KV pool) under their chain `hashes`,
        where neither the block carries a hash already (a matched block) nor another block holds the prefix."""
        for block, h in zip(blocks, hashes):
            if self.hash_of[block] is None and h not in self.cached:
                self.hash_of[block] = h
                self.cached[h] = block

    # ---- allocation ---------------------------------------------------------------

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Append blocks so that `block_table` covers `num_tokens`; False (and no change) if short."""
        needed = self.blocks_for(num_tokens) - len(block_table)
        if needed <= 0:
            return True
        placed = place_blocks(needed, [len(free) for free in self.free_lru])
        if placed is None:
            return False
        for pool in placed:
            block, _ = self.free_lru[pool].popitem(last=False)  # least recently freed
            self._evict(block)
            self.ref_counts[block] = 1
            block_table.append(block)
        return True

    def free(self, block_table: list[int]) -> None:
        """Drop one reference on each block; the table is emptied."""
        for block in reversed(block_table):  # the tail of a prefix is the least reusable: evict it first
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            if self.ref_counts[block] == 0:
                self.free_lru[block % self.pools][block] = None
        block_table.clear()

    def hold(self, blocks: Sequence[int]) -> None:
        """One more reference on each of `blocks` (all in use): none is reused until `free`d once more."""
        for block in blocks:
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"block {block} is free: only a block in use can be held")
            self.ref_counts[block] += 1

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_lru[block % self.pools][block]
        self.ref_counts[block] += 1

    def _evict(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            del self.cached[h]
            self.hash_of[block] = None
