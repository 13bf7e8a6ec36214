"""Context parallelism's pure parts: sharding, the LSE merge, the pass-KV/pass-Q choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from engine.parallel.cp_choice import CPMethod, choose_cp_method
from engine.parallel.cp_merge import merge_partials, partial_attention
from engine.parallel.cp_shard import shard_tokens


@given(st.integers(1, 3000), st.integers(1, 8))
def test_shards_cover_every_token_exactly_once(num_tokens, cp_size):
    shards = shard_tokens(num_tokens, cp_size)
    positions = sorted(p for s in shards for p in s.positions())
    assert positions == list(range(num_tokens))
    assert all(s.num_tokens <= s.padded_len for s in shards)
    assert len({s.padded_len for s in shards}) == 1


def test_rank_i_holds_chunks_i_and_2n_minus_1_minus_i():
    shards = shard_tokens(16, 2)  # chunks of 4: [0,4) [4,8) [8,12) [12,16)
    assert shards[0].ranges == ((0, 4), (12, 16))
    assert shards[1].ranges == ((4, 8), (8, 12))


def test_prompts_shorter_than_2n_chunks_leave_some_ranks_empty_but_valid():
    shards = shard_tokens(3, 4)
    assert [s.num_tokens for s in shards] == [1, 1, 1, 0]
    assert sorted(p for s in shards for p in s.positions()) == [0, 1, 2]


def test_causal_work_is_balanced():
    shards = shard_tokens(4096, 4)
    work = [sum(p + 1 for p in s.positions()) for s in shards]  # keys each query attends to
    assert max(work) / min(work) < 1.01


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


def test_segments_name_each_ranks_chunks_in_block_order():
    from engine.parallel.cp_shard import Segment, kv_segments, query_segments

    shards = shard_tokens(10, 2)  # chunks of 3: [0,3) [3,6) [6,9) [9,10)
    assert query_segments(shards[0]) == (Segment(0, 0, 3), Segment(3, 3, 4))
    assert query_segments(shards[1]) == (Segment(1, 0, 3), Segment(2, 3, 6))
    assert kv_segments(5, query_segments(shards[0])) == (Segment(None, 0, 5), Segment(0, 5, 8), Segment(3, 8, 9))
    assert query_segments(shard_tokens(3, 4)[3]) == ()  # a rank with no new tokens


def test_a_query_chunk_sees_earlier_chunks_whole_its_own_causally_and_later_ones_not():
    from engine.parallel.cp_shard import Visibility, sees

    whole, causal = Visibility.WHOLE, Visibility.CAUSAL
    assert [sees(2, k) for k in (None, 0, 1, 2, 3)] == [whole, whole, whole, causal, None]
