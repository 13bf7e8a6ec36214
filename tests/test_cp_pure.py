"""Context parallelism's pure parts: block layout and runs, the LSE merge, the pass-KV/pass-Q choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from engine.block_manager import BlockManager, place_blocks
from engine.kv_cache import KVStripe
from engine.parallel.cp_choice import CPMethod, choose_cp_method
from engine.parallel.cp_merge import merge_partials, partial_attention
from engine.parallel.cp_shard import stored_positions, stripe_runs


def laid_out(num_tokens: int, cp_size: int, block_size: int = 16, cached: int = 0) -> list[int]:
    """The block table the block manager deals a sequence of `num_tokens` over `cp_size` empty pools."""
    blocks = BlockManager(num_blocks=cp_size * -(-num_tokens // block_size), block_size=block_size, pools=cp_size)
    table: list[int] = []
    assert blocks.grow(table, cached) and blocks.grow(table, num_tokens)
    return table


@given(st.integers(1, 3000), st.integers(0, 700), st.integers(1, 8), st.sampled_from([1, 4, 16]))
def test_runs_cover_every_new_token_once_and_follow_the_blocks(num_tokens, cached, cp_size, block_size):
    cached = min(cached, num_tokens - 1)
    table = laid_out(num_tokens, cp_size, block_size, cached)
    runs = stripe_runs(table, cached, num_tokens, block_size, cp_size)
    assert sorted(p for rank in runs for start, end in rank for p in range(start, end)) == list(range(cached,
                                                                                                         num_tokens))
    for rank, mine in enumerate(runs):
        assert all(a[1] < b[0] for a, b in zip(mine, mine[1:]))  # in order, and merged where they touch
        assert all(table[p // block_size] % cp_size == rank for start, end in mine for p in range(start, end))
        stripe = KVStripe(rank, cp_size)
        assert stored_positions(table, cached, block_size, stripe) == sum(
            1 for p in range(cached) if stripe.stores(table[p // block_size]))


def test_a_prompt_is_laid_out_zigzag_over_the_ranks():
    table = laid_out(16 * 16, 2)  # 16 blocks in 4 groups of 4: ranks 0, 1, 1, 0
    assert [b % 2 for b in table] == [0] * 4 + [1] * 8 + [0] * 4
    assert stripe_runs(table, 0, 256, 16, 2) == [[(0, 64), (192, 256)], [(64, 192)]]


def test_a_chunk_starting_inside_a_block_leaves_its_rest_to_that_blocks_rank():
    table = [1, 0, 3, 2]  # ranks 1, 0, 1, 0
    assert stripe_runs(table, 10, 50, 16, 2) == [[(16, 32), (48, 50)], [(10, 16), (32, 48)]]


def test_causal_work_is_balanced():
    table = laid_out(4096, 4)
    runs = stripe_runs(table, 0, 4096, 16, 4)
    work = [sum(p + 1 for start, end in mine for p in range(start, end)) for mine in runs]  # keys each query sees
    assert max(work) / min(work) < 1.03


def test_few_blocks_go_to_the_pools_with_the_most_free_blocks():
    assert place_blocks(3, [5, 5]) == [0, 1, 0]
    assert place_blocks(1, [2, 7, 7]) == [1]
    assert place_blocks(5, [9, 9, 9]) == [0, 1, 2, 0, 1]  # under 2N blocks: no zigzag


def test_a_full_pool_sends_its_share_to_the_others_and_only_all_together_can_be_short():
    assert place_blocks(8, [1, 10]) == [0, 1, 1, 1, 1, 1, 1, 1]
    assert place_blocks(8, [4, 4]) == [0, 0, 1, 1, 1, 1, 0, 0]
    assert place_blocks(9, [4, 4]) is None
    assert place_blocks(4, [0, 0, 4]) == [2, 2, 2, 2]


def reference_attention(q, k, v, scale):
    """SDPA with a causal mask, as [T, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 5])
def test_merging_partials_over_kv_blocks_is_exact(num_blocks):
    torch.manual_seed(0)
    T, Hq, Hkv, D = 23, 6, 2, 16
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    bounds = torch.linspace(0, T, num_blocks + 1).long().tolist()
    partials = [partial_attention(q, k[a:b], v[a:b], causal[:, a:b], D**-0.5) for a, b in zip(bounds, bounds[1:])]
    out, lse = merge_partials(torch.stack([o for o, _ in partials]), torch.stack([s for _, s in partials]))
    torch.testing.assert_close(out, reference_attention(q, k, v, D**-0.5), atol=1e-5, rtol=1e-5)
    full_scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(3, 1)) * D**-0.5
    torch.testing.assert_close(lse, torch.logsumexp(full_scores.masked_fill(~causal, float("-inf")), -1).T)


def test_a_block_with_no_visible_key_gets_zero_weight():
    q, k, v = torch.randn(2, 1, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    none_visible = torch.zeros(2, 3, dtype=torch.bool)
    out, lse = partial_attention(q, k, v, none_visible, 0.5)
    assert torch.isneginf(lse).all() and not out.isnan().any()
    real = partial_attention(q, k, v, None, 0.5)
    merged, _ = merge_partials(torch.stack([out, real[0]]), torch.stack([lse, real[1]]))
    torch.testing.assert_close(merged, real[0])


H100 = dict(peak_flops=989e12, bandwidth=50e9, bytes_per_element=2)  # bf16 dense, ~400 Gb/s RDMA per GPU


def test_llama3_405b_miss_rate_threshold_is_12_5_percent():
    heads = dict(num_heads=128, num_kv_heads=8, cp_size=4, count_all_to_all=False, **H100)
    # T small enough that the KV ring cannot hide under compute: the miss-rate test decides
    assert choose_cp_method(new_tokens=1000, cached_tokens=6999, **heads).method is CPMethod.PASS_KV  # 12.5%
    assert choose_cp_method(new_tokens=1000, cached_tokens=7001, **heads).method is CPMethod.PASS_Q  # 12.498%


def test_full_prefill_is_always_pass_kv():
    choice = choose_cp_method(new_tokens=10, cached_tokens=0, cp_size=8, num_heads=128, num_kv_heads=8, **H100)
    assert choice.method is CPMethod.PASS_KV and "full prefill" in choice.reason


def test_long_new_context_hides_the_kv_ring_under_compute():
    kwargs = dict(cached_tokens=10_000_000, cp_size=4, num_heads=128, num_kv_heads=8, count_all_to_all=False, **H100)
    bound = 4 * 989e12 * 8 * 2 / (2 * 128 * 50e9)  # N·C·N_KV·e / (2·N_H·BW) ≈ 4945 tokens
    assert choose_cp_method(new_tokens=int(bound) + 1, **kwargs).method is CPMethod.PASS_KV
    assert choose_cp_method(new_tokens=int(bound) - 1, **kwargs).method is CPMethod.PASS_Q


def test_counting_the_all_to_all_lowers_the_miss_rate_bound():
    # T at half the hide bound: Alg. 5's term 4·T·BW/(N·C·e) = N_KV/N_H halves the 12.5% bound to 6.25%
    kwargs = dict(new_tokens=2472, cached_tokens=22_248, cp_size=4, num_heads=128, num_kv_heads=8, **H100)  # 10% miss
    assert choose_cp_method(count_all_to_all=False, **kwargs).method is CPMethod.PASS_Q
    refined = choose_cp_method(count_all_to_all=True, **kwargs)
    assert refined.method is CPMethod.PASS_KV and "0.0625" in refined.reason


def test_segments_name_each_ranks_runs_in_block_order():
    from engine.parallel.cp_shard import Segment, kv_segments, query_segments

    assert query_segments([(0, 3), (9, 10)]) == (Segment(0, 0, 3), Segment(9, 3, 4))
    assert kv_segments(5, query_segments([(0, 3), (9, 10)])) == (Segment(None, 0, 5), Segment(0, 5, 8),
                                                                  Segment(9, 8, 9))
    assert query_segments([]) == ()  # a rank with no new tokens


def test_a_query_run_sees_earlier_runs_whole_its_own_causally_and_later_ones_not():
    from engine.parallel.cp_shard import Visibility, sees

    whole, causal = Visibility.WHOLE, Visibility.CAUSAL
    assert [sees(2, k) for k in (None, 0, 1, 2, 3)] == [whole, whole, whole, causal, None]
