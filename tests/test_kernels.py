"""Triton kernels against plain torch references (under TRITON_INTERPRET=1 on CPU, set in conftest)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_decode, cpu_ops
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


def _paged_case(g, *, batch, heads, kv_heads, head_dim, lens, block_size=16, dtype=torch.float32):
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
    blocks, width = torch.randperm(num_blocks, generator=g).tolist(), max(-(-n // block_size) for n in lens) + 1
    tables = torch.zeros(batch, width, dtype=torch.long)  # each sequence's own scattered blocks, then padding
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        tables[b, :used] = torch.tensor(blocks[:used])
        del blocks[:used]
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2: groups of 3 attended together
    (8, 1, 64),  # one KV head for 8 query heads: two passes of 4
    (4, 2, 128),  # head size 128: passes of 2
    (6, 2, 24),  # a head size the vector path does not take
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_paged_decode_kernel_matches_exact_attention(heads, kv_heads, head_dim, dtype):
    """The C++ kernel reads each sequence's rows through its block table, over chunk boundaries (256 tokens)."""
    assert cpu_ops.available()  # make test installs the compiler: the kernel must build here
    g = torch.Generator().manual_seed(0)
    q, k_cache, v_cache, tables, lens = _paged_case(g, batch=4, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                    lens=[1, 37, 256, 700], dtype=dtype)
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    ref, _ = paged_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 / fp16: the output's own rounding
    torch.testing.assert_close(out.float(), ref, atol=tolerance, rtol=tolerance)


def test_cpu_paged_decode_kernel_takes_a_kv_head_map():
    """Tensor-parallel layouts replicate KV heads: query head h reads the KV head the map names."""
    g = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, tables, lens = _paged_case(g, batch=2, heads=4, kv_heads=3, head_dim=64, lens=[300, 20])
    kv_head_map = torch.tensor([2, 0, 2, 1])
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, kv_head_map)
    for h, kv in enumerate(kv_head_map.tolist()):
        ref, _ = paged_reference(q[:, h:h + 1], k_cache[:, :, kv:kv + 1], v_cache[:, :, kv:kv + 1], tables, lens, 0.125)
        torch.testing.assert_close(out[:, h:h + 1], ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"kv_head_map must give each of 4 query heads a KV head in \[0, 3\)"):
        cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, torch.tensor([0, 1, 2, 3]))


def test_cpu_paged_decode_kernel_is_batch_and_thread_invariant():
    """A sequence's output is bit for bit the same alone or in a batch, on one thread or two: its chunks and
    their merge order depend only on its length (the batch is spread over the threads; each alone, with torch
    on one thread, is attended on the calling thread)."""
    g = torch.Generator().manual_seed(2)
    q, k_cache, v_cache, tables, lens = _paged_case(g, batch=3, heads=9, kv_heads=3, head_dim=64,
                                                    lens=[1500, 5, 700], dtype=torch.bfloat16)
    batched = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for b in range(3):
            alone = cpu_decode.paged_decode(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], lens[b:b + 1], 0.125)
            assert torch.equal(alone[0], batched[b])
    finally:
        torch.set_num_threads(threads)


def test_cpu_paged_decode_kernel_keeps_the_calling_threads_intra_op_count():
    """A thread's intra-op count is its own (engine.threads): the engine's thread keeps its count through its
    first kernel call though another thread (a gRPC handler) set 1 meanwhile. at::parallel_for compiled into
    the kernel's library reset it to the count last set anywhere, and decode through the mesh ran on one core."""
    import threading

    g = torch.Generator().manual_seed(4)
    args = _paged_case(g, batch=2, heads=9, kv_heads=3, head_dim=64, lens=[1600, 600])  # enough to use threads
    engine_ready, other_done, counts = threading.Event(), threading.Event(), []

    def engine_thread():
        torch.set_num_threads(2)
        torch.ones(1 << 20).sum()  # a parallel op: torch has set this thread up
        engine_ready.set()
        other_done.wait()
        cpu_decode.paged_decode(*args, 0.125)  # this thread's first kernel call
        counts.append(torch.get_num_threads())

    def handler_thread():
        engine_ready.wait()
        torch.set_num_threads(1)
        torch.ones(4).sum()
        other_done.set()

    threads = [threading.Thread(target=engine_thread), threading.Thread(target=handler_thread)]
    before = torch.get_num_threads()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        torch.set_num_threads(before)
    assert counts == [2]


def test_cpu_paged_decode_kernel_refuses_reads_outside_the_cache():
    g = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, tables, lens = _paged_case(g, batch=1, heads=9, kv_heads=3, head_dim=64, lens=[40])
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] = 1000 must be in \[1, 64\]"):
        cpu_decode.paged_decode(q, k_cache, v_cache, tables, torch.tensor([1000], dtype=torch.int32), 0.125)
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 1\] = 6 is not a block of the cache"):
        cpu_decode.paged_decode(q, k_cache, v_cache, bad, lens, 0.125)
    with pytest.raises(ValueError, match="must share a dtype"):
        cpu_decode.paged_decode(q.bfloat16(), k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match=r"query heads \(9\) must be a multiple of KV heads \(2\)"):
        cpu_decode.paged_decode(q, k_cache[:, :, :2], v_cache[:, :, :2], tables, lens, 0.125)
    with pytest.raises(ValueError, match="must have 1 rows"):  # the checks every decode kernel makes
        cpu_decode.paged_decode(q, k_cache, v_cache, tables.expand(2, -1), lens, 0.125)


@pytest.mark.parametrize("kernel", [True, False], ids=["C++ kernel", "torch gather and SDPA"])
def test_cpu_decode_attention_through_the_engine_path_is_exact_attention(kernel, monkeypatch):
    """`paged_attention` stores the new token's K/V, then attends with the kernel, or with torch where the
    kernel cannot be built; both against the reference."""
    from engine.attention import build_metadata, paged_attention
    monkeypatch.setattr(cpu_ops, "available", lambda: kernel)
    g = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, head_dim = 16, 6, 2, 64
    k_cache = torch.randn(12, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(12, block_size, kv_heads, head_dim, generator=g)
    tables, contexts = [[9, 2, 7], [4, 5]], [37, 20]
    q, k, v = (torch.randn(2, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    last = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, contexts)]
    meta = build_metadata(slot_mapping=last, decode_block_tables=tables, decode_context_lens=contexts,
                          prefill_chunks=[], block_size=block_size, device=torch.device("cpu"))
    out = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[last], k)
    ref, _ = paged_reference(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mapped", [False, True], ids=["GQA", "kv_head_map"])
def test_a_decode_steps_fused_attention_is_rope_the_cache_write_and_paged_decode_bit_for_bit(dtype, mapped):
    """`fused_decode`, one kernel call from a layer's fused projection (rows of a wider tensor here), computes
    what the unfused path does: q and k rotated in place, k and v written at each token's slot, then the
    paged attention — the same output and the same caches, bit for bit."""
    from engine.attention import RotaryEmbedding, build_metadata, fused_decode, paged_attention, rotate_
    from engine.config import RopeScaling
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block, lens = 9, 3, 64, 16, [1, 17, 40, 300, 5]
    _, k_cache, v_cache, tables, _ = _paged_case(g, batch=5, heads=heads, kv_heads=kv_heads, head_dim=dim,
                                                 lens=lens, dtype=dtype)
    used = [tables[b, : -(-n // block)].tolist() for b, n in enumerate(lens)]
    slots = [t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(used, lens)]  # each new token's
    meta = build_metadata(slot_mapping=slots, decode_block_tables=used, decode_context_lens=lens, prefill_chunks=[],
                          block_size=block, device=torch.device("cpu"))
    assert meta.num_decode == 5 and not meta.prefills
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(5, width + 7, generator=g).to(dtype)[:, :width]  # [5, width], rows 7 apart
    rope = RotaryEmbedding(dim, 512, 10000.0, RopeScaling()).tables(torch.tensor(lens) - 1, dtype)
    kv_head_map = torch.tensor([2, 0, 1, 1, 2, 0, 0, 1, 2]) if mapped else None

    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = ref_qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(5, heads, dim), k.view(5, kv_heads, dim), v.view(5, kv_heads, dim)
    q, k = rotate_(q, *rope), rotate_(k, *rope)
    want = paged_attention(q, k, v, ref_k, ref_v, meta, 0.125, kv_head_map).flatten(1)  # [5, Hq * D]

    got = fused_decode(qkv, rope, k_cache, v_cache, meta, 0.125, heads, kv_head_map)
    assert torch.equal(got, want)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    bad = build_metadata(slot_mapping=[0, 0, 0, 0, k_cache.shape[0] * block], decode_block_tables=used,
                         decode_context_lens=lens, prefill_chunks=[], block_size=block, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"slot_mapping\[4\] = \d+ is not a slot of the cache"):
        fused_decode(qkv, rope, k_cache, v_cache, bad, 0.125, heads, kv_head_map)


def test_the_engine_decodes_through_the_fused_attention_as_through_the_unfused_path(tiny_checkpoint, monkeypatch):
    """Decode-only steps take `fused_decode` (layer by layer: the one-call layers, engine/step_layers.py, off);
    the same requests with it switched off give the same logits bit for bit (mixed steps, prefill chunks with
    decode rows, take the unfused path either way)."""
    import engine.model
    from engine import LLM, SamplingParams
    from engine.step_layers import StepLayers
    from tests.test_parity_tiny import capture_logits, prompts

    folder, _ = tiny_checkpoint("llama")
    monkeypatch.setattr(StepLayers, "of", classmethod(lambda cls, model: None))
    fused, calls = engine.model.fused_decode, []

    def counting(*args, **kwargs):
        out = fused(*args, **kwargs)
        calls.append(out is not None)
        return out

    def run(fused_on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(engine.model, "fused_decode", counting if fused_on else lambda *a, **k: None)
        llm = LLM(str(folder), dtype="bfloat16", max_num_batched_tokens=32)
        captured = capture_logits(llm)
        outs = llm.generate(prompts(6, seed=2), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        llm.close()
        return [torch.stack(captured[o.request_id]) for o in outs]

    with_fused, without = run(True), run(False)
    assert any(calls) and not all(calls)  # decode-only steps fused, steps with prefill chunks not
    assert all(torch.equal(a, b) for a, b in zip(with_fused, without))


@pytest.mark.parametrize("kernel", [True, False], ids=["C++ kernels", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_and_rope_on_cpu_match_transformers(kernel, dtype, monkeypatch):
    """The model's RMSNorm (alone, and after the residual add) and the rotation of query and key heads, with
    the C++ kernels or torch's ops, against transformers' LlamaRMSNorm and apply_rotary_pos_emb: rotations
    exact; norms at most one rounding of the dtype apart (a row's sum of squares runs in another order).
    300 rows of 576 run on two threads."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from engine.attention import RotaryEmbedding, rotate_
    from engine.config import RopeScaling
    from engine.model import RMSNorm
    monkeypatch.setattr(cpu_ops, "available", lambda: kernel)
    g = torch.Generator().manual_seed(0)
    one_rounding = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    for tokens, dim in [(1, 576), (300, 576), (5, 24)]:
        x, delta = ((torch.randn(tokens, dim, generator=g) * 3).to(dtype) for _ in "xd")
        ours, theirs = RMSNorm(dim, 1e-5).to(dtype), LlamaRMSNorm(dim, 1e-5).to(dtype)
        ours.weight.data = theirs.weight.data = torch.randn(dim, generator=g).to(dtype)
        torch.testing.assert_close(ours(x), theirs(x), rtol=one_rounding, atol=1e-6)
        total, normed = ours.add_forward(x, delta)
        assert torch.equal(total, x + delta)
        torch.testing.assert_close(normed, theirs(x + delta), rtol=one_rounding, atol=1e-6)
    exact = 1e-6 if dtype == torch.float32 else 0  # float32: fused multiply-adds
    for tokens, heads, kv_heads, dim in [(1, 9, 3, 64), (40, 12, 4, 64), (7, 3, 1, 24)]:
        rope = RotaryEmbedding(dim, 4096, 10000.0, RopeScaling())
        cos, sin = rope.tables(torch.randint(0, 4096, (tokens,), generator=g), dtype)  # [T, 1, D]
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        q, k, _ = qkv.view(tokens, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], dim=1)  # views
        want_q, want_k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0], unsqueeze_dim=1)
        got_q, got_k = rotate_(q, cos, sin), rotate_(k, cos, sin)
        torch.testing.assert_close(got_q, want_q, rtol=exact, atol=exact)
        torch.testing.assert_close(got_k, want_k, rtol=exact, atol=exact)


def test_cpu_norm_and_rope_kernels_refuse_what_they_cannot_read():
    ops, x, w = cpu_ops.ops(), torch.randn(4, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ops.rms_norm(x.t(), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\]"):
        ops.rms_norm(x, torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        ops.add_rms_norm(x, x, w.double(), 1e-5)
    with pytest.raises(RuntimeError, match="delta must be contiguous"):
        ops.add_rms_norm(x, x[:2], w, 1e-5)
    with pytest.raises(RuntimeError, match="D even"):
        ops.rope_(torch.randn(2, 3, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[2, \.\.\., 8\]"):
        ops.rope_(torch.randn(2, 3, 8), torch.randn(3, 8), torch.randn(2, 8))


def rows_of(dtype: torch.dtype) -> int:
    """How many rows cpu_linear.cpp takes, on every path: 64, but 8 in float32 (MKL's GEMM wins past ~16)."""
    return 8 if dtype == torch.float32 else 64


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo's `flags` line; none where there is no such line, as on Arm)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def best_bf16_path() -> str:
    """The bf16 path cpu_linear.cpp should take here, from the CPU's flags and the build's target
    (INFERMESH_CPU_MARCH: x86-64-v3 has no AVX-512): AMX tiles, else AVX512-BF16 dot products, else FMAs."""
    flags = cpu_flags() if cpu_ops.march() == "native" else set()
    return "amx" if "amx_bf16" in flags else "dot" if {"avx512_bf16", "avx512bw"} <= flags else "fma"


def check_few_row_linear(ops, dtype) -> None:
    """x [M, K] @ weight.T for every M the kernel takes, against float64, over whole 32-weight steps and
    tails (K = 576, 70, 24; 300, 33 and 7 weight rows: AMX's 16-row and the dot path's 4-row blocks with
    tails) and a weight whose rows are strided (a column slice); each row's result bit for bit the same in
    every batch (the dot path reads weight rows one after another up to 8 rows, side by side past them) and
    on one thread or two, also where the sums cancel (there an order changed anywhere shows in every dtype)."""
    g = torch.Generator().manual_seed(0)
    most = ops.linear_rows(dtype)
    rounding = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]

    def same_in_any_batch(x: torch.Tensor, weight: torch.Tensor) -> None:
        full = ops.linear(x, weight)  # [most, rows]
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            alone = [ops.linear(x[i:i + 1], weight) for i in range(most)]
        finally:
            torch.set_num_threads(threads)
        assert all(torch.equal(alone[i][0], full[i]) for i in range(most))
        assert all(torch.equal(ops.linear(x[:m], weight), full[:m]) for m in range(1, most))

    for rows, k in [(300, 576), (320, 576), (33, 70), (7, 24)]:  # (320: whole 32-row tile pairs)
        wide = torch.randn(rows, k + 5, generator=g).to(dtype)
        for weight in (wide[:, :k].contiguous(), wide[:, :k]):
            x = torch.randn(most, k, generator=g).to(dtype)
            want = (x.double() @ weight.double().T).to(dtype)
            torch.testing.assert_close(ops.linear(x, weight), want, rtol=rounding, atol=rounding * k**0.5)
            same_in_any_batch(x, weight)
        cancelling, ones = weight.clone(), x.clone()
        cancelling[::2, 0], cancelling[::2, k - 1] = -2.0**14, 2.0**14  # the first and the last step
        ones[:, 0] = ones[:, k - 1] = 1.0
        same_in_any_batch(ones, cancelling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_few_row_linear_kernel_matches_float64_and_gives_a_row_the_same_result_in_any_batch(dtype):
    """The few-row kernel on the fastest path this CPU has for the dtype (bf16: amx or dot where the CPU has
    them; else fma; 64 rows but 8 in float32) holds its contract (check_few_row_linear)."""
    ops = cpu_ops.ops()
    path = best_bf16_path() if dtype == torch.bfloat16 else "fma"
    assert ops.linear_path(dtype) == path
    assert ops.linear_rows(dtype) == rows_of(dtype)
    check_few_row_linear(ops, dtype)


def with_bf16_cap(cap: str, script: str):
    """`script` run by a fresh Python in the repository with INFERMESH_CPU_BF16=`cap` (read once per process)."""
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "INFERMESH_CPU_BF16": cap}, cwd=Path(__file__).parents[1])


@pytest.mark.parametrize("cap", ["dot", "fma"])
def test_bf16_capped_to_a_slower_path_takes_it_and_it_holds_the_same_contract(cap):
    """INFERMESH_CPU_BF16=dot|fma: bf16 takes that path, or the fastest below it this CPU has (what a CPU
    without AMX, or without AVX512-BF16, runs), with its rows and the same contract."""
    order = ["fma", "dot", "amx"]
    path = order[min(order.index(cap), order.index(best_bf16_path()))]
    done = with_bf16_cap(cap, f"""
import torch
from engine.kernels import cpu_ops
from tests.test_kernels import check_few_row_linear
ops = cpu_ops.ops()
assert ops.linear_path(torch.bfloat16) == {path!r}, ops.linear_path(torch.bfloat16)
assert ops.linear_rows(torch.bfloat16) == {rows_of(torch.bfloat16)}
check_few_row_linear(ops, torch.bfloat16)
""")
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_bf16_cap_the_kernels_do_not_know_is_refused_by_name():
    done = with_bf16_cap("avx", "import torch; from engine.kernels import cpu_ops; "
                                "cpu_ops.ops().linear_rows(torch.bfloat16)")
    assert done.returncode != 0
    assert "INFERMESH_CPU_BF16 must be amx, dot or fma, got 'avx'" in done.stderr


def test_cpu_few_row_linear_kernel_refuses_what_it_does_not_take():
    ops, w = cpu_ops.ops(), torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="x must have 1 to 8 rows in Float, got 9"):
        ops.linear(torch.randn(9, 8), w)
    most = ops.linear_rows(torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"x must have 1 to {most} rows in BFloat16, got {most + 1}"):
        ops.linear(torch.randn(most + 1, 8).bfloat16(), w.bfloat16())
    with pytest.raises(RuntimeError, match=r"x must be \[M, 8\] in Float"):
        ops.linear(torch.randn(2, 7), w)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 8\] in Float, got \[2, 8\] in BFloat16"):
        ops.linear(torch.randn(2, 8).bfloat16(), w)
    with pytest.raises(RuntimeError, match="rows of unit stride"):
        ops.linear(torch.randn(2, 6), w.t())


def check_int8_linear(ops, dtype, batch_invariant: bool = True) -> None:
    """int8 weights with one scale per row (engine/quantize.py): x [M, K] @ (w_int8 * scale).T for every M
    the kernel takes in `dtype` (linear_int8_rows), against float64 over whole steps and tails, each row's
    result bit for bit the same in every batch (not `batch_invariant`: in every batch of 2 rows or more) and
    on one thread or two; refusals name the limit."""
    from engine.quantize import quantize_rows
    g = torch.Generator().manual_seed(0)
    most = ops.linear_int8_rows(dtype)
    rounding = {torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]
    least = 1 if batch_invariant else 2  # the fewest rows of the batches that give a row the same bits
    for rows, k in [(300, 576), (33, 70), (7, 24)]:
        weight, scale = quantize_rows(torch.randn(rows, k, generator=g))
        scale = scale.to(dtype)
        x = torch.randn(most, k, generator=g).to(dtype)
        full = ops.linear_int8(x, weight, scale, batch_invariant)  # [most, rows]
        want = (x.double() @ (weight.double() * scale.double()[:, None]).T).to(dtype)
        torch.testing.assert_close(full, want, rtol=rounding, atol=rounding * k**0.5)
        torch.testing.assert_close(ops.linear_int8(x[:1], weight, scale, batch_invariant), want[:1], rtol=rounding,
                                   atol=rounding * k**0.5)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            alone = [ops.linear_int8(x[i:i + least], weight, scale, batch_invariant) for i in range(most - least + 1)]
        finally:
            torch.set_num_threads(threads)
        assert all(torch.equal(alone[i][0], full[i]) for i in range(most - least + 1))
        assert all(torch.equal(ops.linear_int8(x[:m], weight, scale, batch_invariant), full[:m])
                   for m in range(least, most))
    w, s = quantize_rows(torch.randn(6, 8))
    with pytest.raises(RuntimeError, match=f"x must have 1 to {most} rows in .*, got {most + 1}"):
        ops.linear_int8(torch.randn(most + 1, 8).to(dtype), w, s.to(dtype))
    with pytest.raises(RuntimeError, match="weight must be int8"):
        ops.linear_int8(torch.randn(2, 8), w.float(), s)
    with pytest.raises(RuntimeError, match=r"scale must be \[6\], got \[5\]"):
        ops.linear_int8(torch.randn(2, 8), w, s[:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int8_linear_kernel_matches_float64_and_gives_a_row_the_same_result_in_any_batch(dtype):
    """On this CPU's path: bf16 on AVX512-BF16 (dot: 64 rows; 1-3 as 16 weight rows side by side, more through
    bf16 copies of 4), else float32 FMAs (64 rows in bf16, 16 in float32)."""
    ops = cpu_ops.ops()
    assert ops.linear_int8_rows(dtype) == (64 if dtype == torch.bfloat16 else 16)
    check_int8_linear(ops, dtype)


def test_cpu_int8_linear_kernel_not_batch_invariant_holds_the_same_contract_but_for_a_row_alone():
    """Not batch-invariant: on AMX tiles from 2 rows (one row stays on the dot path), else as batch-invariant.
    On AMX, 2 rows and more with unit scales give what the bf16 kernel's tiles give the same weights as bf16."""
    ops = cpu_ops.ops()
    check_int8_linear(ops, torch.bfloat16, batch_invariant=False)
    if ops.linear_path(torch.bfloat16) == "amx":
        from engine.quantize import quantize_rows
        g = torch.Generator().manual_seed(1)
        for rows, k in [(300, 576), (33, 70)]:
            weight, _ = quantize_rows(torch.randn(rows, k, generator=g))
            x = torch.randn(64, k, generator=g).bfloat16()
            ones = torch.ones(rows, dtype=torch.bfloat16)
            assert all(torch.equal(ops.linear_int8(x[:m], weight, ones, False), ops.linear(x[:m], weight.bfloat16()))
                       for m in (2, 3, 17, 64))


@pytest.mark.parametrize("cap", ["dot", "fma"])
def test_int8_weights_capped_to_a_slower_path_hold_the_same_contract(cap):
    """INFERMESH_CPU_BF16=dot|fma: bf16 activations take the AVX512-BF16 dot path or the float32-FMA int8 path
    (64 rows either way), as on a CPU without AMX or without AVX512-BF16, batch-invariant or not."""
    done = with_bf16_cap(cap, """
import torch
from engine.kernels import cpu_ops
from tests.test_kernels import check_int8_linear
assert cpu_ops.ops().linear_int8_rows(torch.bfloat16) == 64
check_int8_linear(cpu_ops.ops(), torch.bfloat16)
check_int8_linear(cpu_ops.ops(), torch.bfloat16, batch_invariant=False)
""")
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_int8_layer_takes_the_int8_kernel_and_torchs_where_the_kernels_are_not_built(
        monkeypatch):
    from engine.quantize import Int8Linear
    layer = Int8Linear.from_linear(torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16))
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(layer(x), cpu_ops.ops().linear_int8(x, layer.weight, layer.scale) + layer.bias)
    assert layer(x[:0]).shape == (0, 48)  # a step that samples no row (a prefill chunk mid-prompt)
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    torch_kernel = torch.ops.aten._weight_int8pack_mm(x, layer.weight, layer.scale) + layer.bias
    assert torch.equal(layer(x), torch_kernel)


def test_the_engine_sends_rows_to_the_few_row_kernel_where_it_is_invariant_as_far_as_torch_is():
    """Batch-invariant (the default), a layer takes the kernel only where it keeps at least the rows torch's
    GEMM keeps invariant (32): bf16 on AMX or AVX512-BF16 (64 rows); without batch invariance, wherever it
    runs."""
    from engine.model import INVARIANT_ROWS
    from engine.parallel.parallelize import few_rows
    ops = cpu_ops.ops()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        most = ops.linear_rows(dtype)
        assert few_rows(dtype, batch_invariant=False) == most
        assert few_rows(dtype, batch_invariant=True) == (most if most >= INVARIANT_ROWS else 0)
    assert few_rows(torch.float32, batch_invariant=True) == 0


def test_linear_takes_the_few_row_kernel_only_where_asked_and_up_to_its_rows(monkeypatch):
    """Batch-invariant (the default): torch's GEMM, one bf16 row as `mv`. With `few_rows`: 1..8 rows
    through the kernel, more through torch's GEMM; where the kernels are not built, torch's GEMM again."""
    from engine.model import Linear
    g = torch.Generator().manual_seed(0)
    linear = Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(9, 64, generator=g).bfloat16()
    gemm = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert torch.equal(linear(x[:3]), gemm[:3]) and torch.equal(linear(x), gemm)
    linear.few_rows = 8
    assert torch.equal(linear(x[:3]), cpu_ops.ops().linear(x[:3], linear.weight) + linear.bias)
    assert torch.equal(linear(x), gemm)
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    assert torch.equal(linear(x[:3]), gemm[:3])


@pytest.mark.slow
def test_cpu_kernels_build_past_a_stale_lock_and_a_cut_short_library_and_say_when_they_are_not_used(tmp_path):
    """The build as a fresh machine meets it: a lock left by a killed build does not stall it, a library cut
    short by one is built again, and without a compiler, or switched off, the engine is told why (and attends
    with torch)."""
    import os
    import subprocess
    import sys
    import time

    def build(env_dir, **env):
        return subprocess.run([sys.executable, "-m", "engine.kernels.cpu_ops"], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(env_dir), **env})

    library = cpu_ops.library_path(tmp_path)
    library.parent.mkdir(parents=True)
    (library.parent / "lock").touch()  # both at once, one build: the lock of a build killed an hour ago...
    os.utime(library.parent / "lock", (time.time() - 3600,) * 2)
    library.write_bytes(b"\x7fELF cut short")  # ...and the library it left cut short
    assert build(tmp_path).returncode == 0
    assert library.read_bytes()[:4] == b"\x7fELF" and library.stat().st_size > 10_000
    assert not (library.parent / "lock").exists()  # released when the build finished
    failed = build(tmp_path / "no-compiler", CXX="false")
    assert failed.returncode == 1 and "CPU kernels not built" in failed.stderr
    off = build(tmp_path, INFERMESH_CPU_KERNELS="off")  # built, but switched off
    assert off.returncode == 1 and "CPU kernels off (INFERMESH_CPU_KERNELS)" in off.stderr


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64" or not {"avx2", "fma", "bmi2"} <= cpu_flags(),
                    reason="the x86-64-v3 build runs on an x86 CPU with AVX2 and FMA")
def test_the_kernels_built_for_avx2_alone_hold_every_contract_on_this_cpu():
    """INFERMESH_CPU_MARCH=x86-64-v3 builds the AVX2 paths (no AVX-512, whatever this CPU has): this file's
    CPU kernel tests and the one-call layers' (tests/test_step_layers.py), run against that build, pass as
    they do against the native one."""
    import os
    import subprocess
    import sys

    for selection in ([__file__, "-k", "cpu and not avx2_alone and not build_past"],
                      [str(Path(__file__).parent / "test_step_layers.py")]):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
                              capture_output=True, text=True, timeout=1200, cwd=Path(__file__).parents[1],
                              env={**os.environ, "INFERMESH_CPU_MARCH": "x86-64-v3"})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert " passed" in done.stdout and " failed" not in done.stdout
