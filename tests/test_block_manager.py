"""Block manager: allocation, freeing, prefix reuse, LRU eviction, no leaks."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, block_hash, prefix_hashes


def filled(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate and 'compute' a sequence, publishing its full blocks."""
    table, chain = bm.match_prefix(tokens)
    assert bm.grow(table, len(tokens))
    bm.cache_full_blocks(table, tokens, len(tokens), chain)
    return table, chain


def test_grow_allocates_ceil_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    assert bm.grow(table, 9)
    assert len(table) == 3 and bm.num_free_blocks == 5
    assert bm.grow(table, 12) and len(table) == 3  # still fits
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 8


def test_grow_refuses_without_partial_allocation():
    bm = BlockManager(num_blocks=2, block_size=4)
    table: list[int] = []
    assert not bm.grow(table, 9)
    assert table == [] and bm.num_free_blocks == 2


def test_prefix_of_a_finished_sequence_is_reused():
    bm = BlockManager(num_blocks=16, block_size=4)
    first, _ = filled(bm, list(range(10)))
    bm.free(list(first))
    blocks, hashes = bm.match_prefix(list(range(10)) + [99, 98])
    assert blocks == first[:2]  # two full blocks; the partial third is not cached
    assert hashes == prefix_hashes(list(range(8)), 4)


def test_match_leaves_the_last_token_uncomputed():
    bm = BlockManager(num_blocks=16, block_size=4)
    table, _ = filled(bm, list(range(8)))
    blocks, _ = bm.match_prefix(list(range(8)))
    assert blocks == table[:1]  # the second block holds the last token: recompute it


def test_shared_blocks_are_freed_only_when_every_owner_frees():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, _ = filled(bm, list(range(9)))
    b, _ = bm.match_prefix(list(range(9)))
    assert b == a[:2] and bm.ref_counts[a[0]] == 2
    bm.free(list(a))
    assert bm.ref_counts[b[0]] == 1
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_least_recently_freed_cached_block_is_evicted_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, _ = filled(bm, [1, 2, 3])
    new, _ = filled(bm, [7, 8, 9])
    bm.free(list(old))
    bm.free(list(new))
    table: list[int] = []
    assert bm.grow(table, 4)  # two blocks: the old sequence's (tail first) go before the new one's
    assert bm.match_prefix([1, 2, 3]) == ([], [])
    assert bm.match_prefix([7, 8, 9])[0] == new[:1]


def test_block_hash_is_blake2b_of_parent_and_int32_ids():
    """The hashes are published in the registry and compared across processes (and versions): their bytes are
    the parent's 8 and each id's 4, little-endian, as hashlib hashes them here."""
    parent = block_hash(None, [1, -2])
    data = bytes(8) + (1).to_bytes(4, "little") + (-2).to_bytes(4, "little", signed=True)
    assert parent == int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    data = parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in (49151, 0, 7))
    assert block_hash(parent, [49151, 0, 7]) == int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def test_hash_chain_depends_on_the_whole_prefix():
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [0, 0]), [1, 2])
    assert prefix_hashes([1, 2, 3, 4, 5], 2) == [block_hash(None, [1, 2]), block_hash(block_hash(None, [1, 2]), [3, 4])]


def test_freeing_twice_is_an_error():
    bm = BlockManager(num_blocks=2, block_size=2)
    table: list[int] = []
    bm.grow(table, 2)
    copy = list(table)
    bm.free(table)
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(copy)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5),
                          st.lists(st.integers(0, 3), min_size=1, max_size=20)), max_size=60))
@pytest.mark.parametrize("pools", [1, 3])
def test_no_blocks_leak_after_any_sequence_of_requests(pools, ops):
    bm = BlockManager(num_blocks=12, block_size=3, pools=pools)
    live: dict[int, tuple[list[int], list[int], list[int]]] = {}  # slot -> (table, chain, tokens)
    for op, slot, tokens in ops:
        if op == "add" and slot not in live:
            table, chain = bm.match_prefix(tokens)
            if bm.grow(table, len(tokens)):
                bm.cache_full_blocks(table, tokens, len(tokens), chain)
                live[slot] = (table, chain, list(tokens))
            else:
                bm.free(table)
        elif op == "grow" and slot in live:
            table, chain, seq_tokens = live[slot]
            if bm.grow(table, len(seq_tokens) + len(tokens)):
                seq_tokens += tokens
                bm.cache_full_blocks(table, seq_tokens, len(seq_tokens), chain)
        elif op == "free" and slot in live:
            bm.free(live.pop(slot)[0])
        used = sum(len(t) for t, _, _ in live.values())
        assert sum(bm.ref_counts) == used
        assert bm.num_free_blocks == sum(1 for r in bm.ref_counts if r == 0)
        assert bm.used_blocks_per_pool() == [sum(1 for b, r in enumerate(bm.ref_counts) if r and b % pools == p)
                                             for p in range(pools)]
    for table, _, _ in live.values():
        bm.free(table)
    assert bm.num_free_blocks == 12 and not any(bm.ref_counts)


def test_pools_deal_global_ids_by_pool_and_refuse_only_when_all_are_short():
    bm = BlockManager(num_blocks=8, block_size=4, pools=2)  # pool 0: blocks 0 2 4 6, pool 1: 1 3 5 7
    first: list[int] = []
    assert bm.grow(first, 4 * 4)  # four blocks: zigzag over the two pools
    assert [b % 2 for b in first] == [0, 1, 1, 0] and bm.used_blocks_per_pool() == [2, 2]
    second: list[int] = []
    assert not bm.grow(second, 5 * 4) and second == [] and bm.num_free_blocks == 4
    assert bm.grow(second, 4 * 4) and sorted(first + second) == list(range(8))
    bm.free(first)
    assert bm.used_blocks_per_pool() == [2, 2]


def test_pool_count_must_divide_the_blocks():
    with pytest.raises(ValueError, match="num_blocks=9 must be a multiple of pools=2"):
        BlockManager(num_blocks=9, block_size=4, pools=2)
