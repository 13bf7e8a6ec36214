"""The CPU prefill attention kernel (engine/kernels/cpu_prefill_attention.cpp) against exact attention in
float64, and the engine's paths through it (a chunk after a cached prefix, context-parallel blocks)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_ops, cpu_prefill
from tests.test_kernels import best_bf16_path, with_bf16_cap


def exact(q, k, v, scale, causal, kv_head_map=None):
    """float64 attention -> (out [n, Hq, D], lse [n, Hq]); causal: the queries are the keys' last n."""
    n, m = q.shape[0], k.shape[0]
    if kv_head_map is None:
        kv_head_map = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k[:, kv_head_map], v[:, kv_head_map]))  # [H, T, D]
    scores = qd @ kd.transpose(-1, -2) * scale  # [H, n, m]
    if causal:
        scores = scores.masked_fill(torch.arange(m)[None, :] > torch.arange(m - n, m)[:, None], float("-inf"))
    return (torch.softmax(scores, -1) @ vd).transpose(0, 1), torch.logsumexp(scores, -1).transpose(0, 1)


def random_qkv(g, n, m, heads, kv_heads, head_dim, dtype):
    return tuple(torch.randn(rows, h, head_dim, generator=g).to(dtype)
                 for rows, h in ((n, heads), (m, kv_heads), (m, kv_heads)))


CASES = [  # queries, keys, causal
    (130, 130, True),  # a whole prompt, over query and key blocks of 64
    (70, 200, True),  # a chunk after a cached prefix of 130
    (1, 77, True),  # one token after a prefix
    (33, 100, False),  # every key visible (context-parallel blocks attended whole)
]


def check_prefill_attention(dtype: torch.dtype) -> None:
    """The kernel's contract in `dtype` on every head size it takes (also run under INFERMESH_CPU_BF16 caps)."""
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, head_dim in ((9, 3, 64), (4, 2, 128), (4, 1, 32), (2, 2, 16)):
        for n, m, causal in CASES:
            q, k, v = random_qkv(g, n, m, heads, kv_heads, head_dim, dtype)
            out, lse = cpu_prefill.prefill_attention(q, k, v, head_dim**-0.5, causal)
            ref, ref_lse = exact(q, k, v, head_dim**-0.5, causal)
            assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 / fp16: the output's own rounding
            torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_attention_kernel_matches_exact_attention(dtype):
    assert cpu_ops.available()  # make test installs the compiler: the kernel must build here
    check_prefill_attention(dtype)


@pytest.mark.parametrize("cap", ["dot", "fma"])
def test_prefill_attention_holds_its_contract_on_every_bf16_path(cap):
    """bf16 on AVX512-BF16 dot products, and as float32 FMAs (a CPU without them, or capped)."""
    done = with_bf16_cap(cap, """
import torch
from tests.test_prefill_attention import check_prefill_attention
check_prefill_attention(torch.bfloat16)
""")
    assert done.returncode == 0, done.stderr[-2000:]


def test_prefill_attention_takes_a_kv_head_map_and_rows_of_a_fused_projection():
    """Query heads mapped to KV heads in any order (tensor-parallel shards), and q, k, v as views into one
    [n, (Hq + 2 Hkv) D] projection: rows strided, each row's heads dense."""
    g = torch.Generator().manual_seed(1)
    n, heads, kv_heads, head_dim = 90, 4, 2, 64
    fused = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)
    assert q.stride(0) == fused.shape[1]
    kv_head_map = torch.tensor([1, 0, 0, 1])
    out, lse = cpu_prefill.prefill_attention(q, k, v, 0.125, True, kv_head_map)
    ref, ref_lse = exact(q, k, v, 0.125, True, kv_head_map)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_in_any_chunk_and_with_any_thread_count(dtype):
    """A query's result depends only on its own keys: a prompt's chunk after its cached prefix gives each of
    its queries the bits the whole prompt gives them, on one thread or two."""
    g = torch.Generator().manual_seed(2)
    q, k, v = random_qkv(g, 300, 300, 9, 3, 64, dtype)
    whole, whole_lse = cpu_prefill.prefill_attention(q, k, v, 0.125, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for first, last in ((0, 40), (40, 190), (190, 300)):  # chunks, each after the ones before
            chunk, chunk_lse = cpu_prefill.prefill_attention(q[first:last], k[:last], v[:last], 0.125, True)
            assert torch.equal(chunk, whole[first:last]) and torch.equal(chunk_lse, whole_lse[first:last])
    finally:
        torch.set_num_threads(threads)


def test_prefill_attention_refuses_what_it_cannot_read():
    q, k = torch.randn(8, 4, 64), torch.randn(8, 2, 64)
    ops = cpu_ops.ops()
    with pytest.raises(RuntimeError, match="head_dim must be 16, 32, 64 or 128 and the same in q and k, got 24"):
        ops.prefill_attention(q[..., :24].contiguous(), k[..., :24].contiguous(), k[..., :24].contiguous(),
                              torch.tensor([0, 0, 1, 1]), 0.1, True)
    with pytest.raises(RuntimeError, match="causal attention needs at least as many keys as queries, got 4 keys "
                                           "for 8 queries"):
        ops.prefill_attention(q, k[:4], k[:4], torch.tensor([0, 0, 1, 1]), 0.1, True)
    with pytest.raises(RuntimeError, match=r"kv_head\[3\] = 2 is not in \[0, 2\)"):
        ops.prefill_attention(q, k, k, torch.tensor([0, 0, 1, 2]), 0.1, True)
    with pytest.raises(RuntimeError, match="q, k and v must share a dtype"):
        ops.prefill_attention(q.bfloat16(), k, k, torch.tensor([0, 0, 1, 1]), 0.1, True)
    with pytest.raises(RuntimeError, match="each row's heads must be dense"):
        ops.prefill_attention(q.transpose(0, 1), k, k, torch.tensor([0, 0, 1, 1]), 0.1, False)
    with pytest.raises(ValueError, match="3 query heads do not group over 2 KV heads"):
        cpu_prefill.prefill_attention(q[:, :3], k, k, 0.1)


def test_the_engine_attends_bf16_prompts_with_the_kernel_only_where_the_cpu_has_bf16_dot_products():
    q = torch.randn(4, 9, 64).bfloat16()
    assert cpu_prefill.takes(q, q[:, :3]) == (best_bf16_path() == "dot")
    assert not cpu_prefill.takes(q.float(), q[:, :3].float())  # torch's SDPA is as fast in float32
    assert not cpu_prefill.takes(q[..., :24], q[:, :3, :24])


@pytest.mark.parametrize("kernel", [True, False], ids=["C++ kernel", "torch SDPA"])
def test_prompt_attention_through_the_engine_path_is_exact_attention(kernel, monkeypatch):
    """`paged_attention` on two prompt chunks in one step, one whole and one after a cached prefix read
    from its blocks, with the kernel or with torch's SDPA; both against the reference."""
    from engine.attention import build_metadata, paged_attention
    monkeypatch.setattr(cpu_prefill, "takes", lambda q, k: kernel)
    g = torch.Generator().manual_seed(3)
    block_size, heads, kv_heads, head_dim = 16, 6, 2, 64
    k_cache, v_cache = (torch.randn(20, block_size, kv_heads, head_dim, generator=g) for _ in "kv")
    whole, prefix, chunk = 40, 50, 30  # prompt A: 40 new tokens; prompt B: 30 new after 50 cached
    table_a, table_b = [3, 7, 1], [12, 4, 9, 15, 2]
    slots = [t[i // block_size] * block_size + i % block_size
             for t, lo, hi in ((table_a, 0, whole), (table_b, prefix, prefix + chunk)) for i in range(lo, hi)]
    q, k, v = (torch.randn(whole + chunk, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    meta = build_metadata(slot_mapping=slots, decode_block_tables=[], decode_context_lens=[],
                          prefill_chunks=[(whole, whole, table_a), (chunk, prefix + chunk, table_b)],
                          block_size=block_size, device=torch.device("cpu"))
    out = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    context_b = k_cache[table_b].flatten(0, 1)[: prefix + chunk], v_cache[table_b].flatten(0, 1)[: prefix + chunk]
    ref_a, _ = exact(q[:whole], k[:whole], v[:whole], head_dim**-0.5, True)
    ref_b, _ = exact(q[whole:], *context_b, head_dim**-0.5, True)
    torch.testing.assert_close(out.double(), torch.cat([ref_a, ref_b]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [True, False], ids=["C++ kernel", "torch flash kernel"])
@pytest.mark.parametrize("causal", [True, False])
def test_context_parallel_blocks_attend_with_their_lse_through_the_kernel(kernel, causal, monkeypatch):
    """Ring attention's partial attention of one block (`attention_with_lse`: [1, H, T, D], heads already
    per query head) gives the exact output and log-sum-exp either way."""
    from engine.parallel.cp_merge import attention_with_lse
    monkeypatch.setattr(cpu_prefill, "takes", lambda q, k: kernel)
    g = torch.Generator().manual_seed(4)
    q, k, v = random_qkv(g, 48, 48, 4, 4, 32, torch.float32)
    out, lse = attention_with_lse(*(t.transpose(0, 1)[None] for t in (q, k, v)), None, 0.2, causal=causal)
    ref, ref_lse = exact(q, k, v, 0.2, causal)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out[0].transpose(0, 1).double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0].transpose(0, 1).double(), ref_lse, atol=1e-5, rtol=1e-5)
