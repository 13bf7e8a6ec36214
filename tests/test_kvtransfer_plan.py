"""The KV transfer plan: every element exactly once, between any CP and TP layouts and block sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.parallel.cp_shard import stripe_runs
from engine.parallel.tp import head_shard
from kvtransfer.plan import DecodeLayout, PrefillLayout, plan
from tests.test_parallel_runtime import tiny_config


def layouts(num_tokens, cp, tp, heads, kv_heads, src_block, dst_block, first_token, seed):
    g = torch.Generator().manual_seed(seed)
    src_blocks, dst_blocks = -(-num_tokens // src_block), -(-num_tokens // dst_block)
    table = tuple(torch.randperm(src_blocks + 3, generator=g)[:src_blocks].tolist())
    src = PrefillLayout(token_ranges=tuple(map(tuple, stripe_runs(table, 0, num_tokens, src_block, cp))),
                        num_kv_heads=kv_heads, block_size=src_block, block_table=table)
    cfg = tiny_config(num_heads=heads, num_kv_heads=kv_heads)
    dst = DecodeLayout(head_ranges=tuple(head_shard(cfg, tp, r).kv_heads for r in range(tp)), block_size=dst_block,
                       block_table=tuple(torch.randperm(dst_blocks + 2, generator=g)[:dst_blocks].tolist()),
                       first_token=first_token)
    return src, dst


@settings(max_examples=150, deadline=None)
@given(num_tokens=st.integers(1, 300), cp=st.integers(1, 4), tp=st.integers(1, 4),
       kv_heads=st.sampled_from([1, 2, 3, 4, 8]), src_block=st.sampled_from([1, 4, 16]),
       dst_block=st.sampled_from([1, 8, 16, 32]), cached=st.floats(0, 0.9), seed=st.integers(0, 1000))
def test_every_token_and_head_reaches_every_rank_that_stores_it_exactly_once(
        num_tokens, cp, tp, kv_heads, src_block, dst_block, cached, seed):
    heads = kv_heads * 4 if kv_heads * 4 >= tp else tp * kv_heads
    first = int(num_tokens * cached)
    src, dst = layouts(num_tokens, cp, tp, heads, kv_heads, src_block, dst_block, first, seed)
    covered = [torch.zeros(num_tokens, end - start, dtype=torch.int32) for start, end in dst.head_ranges]
    for p in plan(src, dst):
        assert any(a <= p.tokens[0] and p.tokens[1] <= b for a, b in src.token_ranges[p.src_rank])
        assert p.heads == dst.head_ranges[p.dst_rank]
        for i, t in enumerate(range(*p.tokens)):  # consecutive slots on both sides
            assert p.src_slot + i == src.block_table[t // src_block] * src_block + t % src_block
            assert p.dst_slot + i == dst.block_table[t // dst_block] * dst_block + t % dst_block
        covered[p.dst_rank][p.tokens[0]:p.tokens[1]] += 1
    for grid in covered:
        assert torch.all(grid[first:] == 1) and torch.all(grid[:first] == 0)


@pytest.mark.parametrize("cp,tp", [(2, 2), (3, 4), (1, 3), (4, 1)])
def test_moving_by_the_plan_reproduces_the_kv_bit_exactly(cp, tp):
    num_tokens, kv_heads, head_dim, layers = 45, 3, 8, 2
    src, dst = layouts(num_tokens, cp, tp, 9, kv_heads, 4, 16, 0, seed=cp * 10 + tp)
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(layers, num_tokens, kv_heads, head_dim, generator=g).to(torch.bfloat16)  # [L, T, H, D]
    src_caches = []
    for ranges in src.token_ranges:  # each CP rank fills only the slots of its tokens
        cache = torch.zeros(layers, len(src.block_table) * 4 + 20, kv_heads, head_dim, dtype=torch.bfloat16)
        for start, end in ranges:
            for t in range(start, end):
                cache[:, src.block_table[t // 4] * 4 + t % 4] = truth[:, t]
        src_caches.append(cache)
    dst_caches = [torch.zeros(layers, 64 * 16, end - start, head_dim, dtype=torch.bfloat16)
                  for start, end in dst.head_ranges]
    for layer in range(layers):  # layer by layer, as the transports push
        for p in plan(src, dst):
            n = p.num_tokens
            dst_caches[p.dst_rank][layer, p.dst_slot:p.dst_slot + n] = \
                src_caches[p.src_rank][layer, p.src_slot:p.src_slot + n, p.heads[0]:p.heads[1]]
    for cache, (h0, h1) in zip(dst_caches, dst.head_ranges):
        for t in range(num_tokens):
            assert torch.equal(cache[:, dst.block_table[t // 16] * 16 + t % 16], truth[:, t, h0:h1])


def test_layouts_that_cannot_hold_the_tokens_are_refused():
    with pytest.raises(ValueError, match=r"decode block table has 1 blocks of 16 \(16 slots\) for 40 tokens"):
        plan(PrefillLayout(token_ranges=(((0, 40),),), num_kv_heads=2, block_size=16, block_table=(0, 1, 2)),
             DecodeLayout(head_ranges=((0, 2),), block_size=16, block_table=(0,)))
    with pytest.raises(ValueError, match="exceed the 2 KV heads of prefill"):
        plan(PrefillLayout(token_ranges=(((0, 4),),), num_kv_heads=2, block_size=4, block_table=(0,)),
             DecodeLayout(head_ranges=((0, 3),), block_size=4, block_table=(0,)))
    with pytest.raises(ValueError, match="must be disjoint"):
        PrefillLayout(token_ranges=(((0, 4),), ((2, 6),)), num_kv_heads=2, block_size=4, block_table=(0, 1))
