"""Triton kernels against plain torch references (under TRITON_INTERPRET=1 on CPU, set in conftest)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.lse_merge import merge_lse
from engine.kernels.moe_permute import combine_rows, permute_rows
from engine.kernels.paged_decode import paged_decode_attention
from engine.parallel.cp_merge import merge_partials, partial_attention


def paged_reference(q, k_cache, v_cache, tables, lens, scale):
    """Gather each sequence's keys from its blocks, then exact attention with LSE."""
    outs, lses = [], []
    block_size = k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n]  # [n, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:n]
        o, lse = partial_attention(q[b:b + 1], k, v, None, scale)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,splits", [
    (4, 2, 16, 4, 3),  # GQA, several splits
    (3, 3, 24, 8, 1),  # head_dim not a power of two, one split
    (8, 1, 32, 16, 4),  # MQA; some splits get no blocks for short sequences
])
def test_paged_decode_attention_matches_exact_attention(heads, kv_heads, head_dim, block_size, splits):
    g = torch.Generator().manual_seed(0)
    num_blocks, batch = 24, 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    lens = torch.tensor([1, block_size * 2 + 3, block_size * 5], dtype=torch.int32)
    # int32 tables, or the engine's int64 ones (indexing the cache on CPU too)
    tables = torch.randperm(num_blocks, generator=g)[: batch * 6].view(batch, 6)
    tables = tables.to(torch.int32 if splits != 3 else torch.long)
    q = torch.randn(batch, heads, head_dim, generator=g)
    out, lse = paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, num_splits=splits)
    ref_out, ref_lse = paged_reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_refuses_mismatched_shapes():
    q = torch.randn(2, 4, 16)
    cache = torch.randn(8, 4, 3, 16)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of KV heads \(3\)"):
        paged_decode_attention(q, cache, cache, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                               1.0)
    with pytest.raises(ValueError, match="must have 2 rows"):
        paged_decode_attention(q, cache[:, :, :2], cache[:, :, :2], torch.zeros(3, 2, dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32), 1.0)


def test_lse_merge_kernel_equals_the_torch_merge_including_empty_partials():
    g = torch.Generator().manual_seed(1)
    outputs = torch.randn(4, 5, 3, 24, generator=g)
    lses = torch.randn(4, 5, 3, generator=g)
    lses[1, 2] = float("-inf")  # a partial that saw no key
    lses[:, 4, 0] = float("-inf")  # a row that saw no key anywhere
    outputs[:, 4, 0] = 0.0
    out, lse = merge_lse(outputs, lses)
    ref_out, ref_lse = merge_partials(outputs, lses)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    assert lse[4, 0] == float("-inf") and torch.all(out[4, 0] == 0)


def test_lse_merge_refuses_non_float32_partials():
    with pytest.raises(ValueError, match="partials must be float32"):
        merge_lse(torch.zeros(2, 1, 1, 4, dtype=torch.bfloat16), torch.zeros(2, 1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_permute_and_combine_match_indexing(dtype):
    g = torch.Generator().manual_seed(2)
    tokens, top_k, dim = 7, 2, 200  # dim spans two column blocks
    x = torch.randn(tokens, dim, generator=g).to(dtype)
    ids = torch.randint(0, 4, (tokens, top_k), generator=g)
    order = torch.argsort(ids.flatten(), stable=True)
    permuted = permute_rows(x, order // top_k)
    assert torch.equal(permuted, x[order // top_k])
    y = torch.randn(tokens * top_k, dim, generator=g).to(dtype)  # expert outputs, in permuted order
    weights = torch.rand(tokens, top_k, generator=g)
    slot_rows = torch.empty_like(order)
    slot_rows[order] = torch.arange(len(order))  # where each (token, choice) landed
    slot_rows = slot_rows.view(tokens, top_k)
    expected = (y[slot_rows].float() * weights[..., None]).sum(1).to(dtype)
    torch.testing.assert_close(combine_rows(y, slot_rows, weights), expected, atol=1e-5, rtol=1e-2)
    assert permute_rows(x, torch.empty(0, dtype=torch.long)).shape == (0, dim)  # nothing routed here


@pytest.mark.parametrize("table,wide_from", [([5, 6, 7], 2048), ([5, 6, 7], 1), ([9, 2, 7], 1)],
                         ids=["blocks in a row", "blocks in a row, as one wide head", "scattered blocks"])
def test_torch_decode_attention_over_a_view_or_a_gather_is_exact_attention(table, wide_from, monkeypatch):
    """One decode sequence whose blocks lie in a row is attended over a view of the cache (no gather), from
    `WIDE_MIN_TOKENS` on as one head of width Hkv * D: the same attention as over scattered blocks, checked
    against the reference."""
    from engine import attention
    from engine.attention import build_metadata, paged_attention

    monkeypatch.setattr(attention, "WIDE_MIN_TOKENS", wide_from)

    g = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, head_dim, context = 16, 6, 2, 8, 37
    k_cache = torch.randn(12, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(12, block_size, kv_heads, head_dim, generator=g)
    q, k, v = (torch.randn(1, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    last = table[(context - 1) // block_size] * block_size + (context - 1) % block_size  # the new token's slot
    meta = build_metadata(slot_mapping=[last], decode_block_tables=[table], decode_context_lens=[context],
                          prefill_chunks=[], block_size=block_size, device=torch.device("cpu"))
    assert (meta.decode_run is not None) == (table == [5, 6, 7])
    out = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    ref_out, _ = paged_reference(q, k_cache, v_cache, torch.tensor([table]), torch.tensor([context]),
                                 head_dim**-0.5)
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[last], k[0])
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
