"""A parallel engine (TP, CP, EP, TP×EP over real gloo rank processes) gives exactly what one rank gives.

Each layout runs the same two calls as a single-rank engine: a continuous batch of
prompts of 1, 7, 33 and 50 tokens (lengths not divisible by 2N, a prompt shorter
than 2N chunks), then prompts that extend the first ones, so their cached prefix is
reused (partial prefill). Greedy tokens must be identical and the logits of every
step within 1e-4 (fp32); a CP engine uses the method it was told, or by `auto` pass-KV
for full prefills and pass-Q for the partial ones. SmolLM2 on a 2,100-token prompt:
TP=2 and CP=2 give the single rank's tokens and logits.
"""

from __future__ import annotations

import functools

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import TINY_VOCAB
from tests.test_parity_tiny import capture_logits

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def two_calls() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(7)
    first = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (1, 7, 33, 50)]
    extension = torch.randint(3, TINY_VOCAB, (21,), generator=g).tolist()
    return first, [first[2] + extension, first[3] + extension[:5]]


def run_with_logits(llm: LLM) -> list[tuple[list[int], torch.Tensor, int]]:
    """(tokens, logits [steps, V], cached prompt tokens) per request of both calls."""
    captured = capture_logits(llm)
    first, second = two_calls()
    outs = llm.generate(first, GREEDY) + llm.generate(second, GREEDY)
    return [(o.token_ids, torch.stack(captured[o.request_id]), o.cached_prompt_tokens) for o in outs]


def record_cp_methods(llm: LLM) -> list[tuple[int, int, str]]:
    """From now on, per prefill chunk of a CP engine: (its new tokens, its cached tokens, the method used)."""
    methods, run = [], llm.engine.run_model

    def recording(chunks):
        out = run(chunks)
        by_id = {c.seq.request_id: c for c in chunks}
        methods.extend((by_id[rid].num_tokens, by_id[rid].seq.num_cached_prompt_tokens, choice.method.value)
                       for rid, choice in llm.engine.last_cp_choices.items())
        return out

    llm.engine.run_model = recording
    return methods


@pytest.fixture(scope="module")
def single_rank(tiny_checkpoint):
    @functools.cache
    def reference(arch: str):
        folder, _ = tiny_checkpoint(arch)
        return run_with_logits(LLM(str(folder), dtype="float32", block_size=8))

    return reference


LAYOUTS = [
    ("llama", dict(tp=2)),
    ("llama", dict(tp=4)),
    ("llama", dict(cp=2)),
    ("llama", dict(cp=3, cp_method="pass_q")),
    ("llama", dict(cp=4, cp_method="pass_kv")),
    ("qwen3", dict(tp=2)),
    ("qwen3", dict(cp=2, cp_method="pass_q")),
    ("mixtral", dict(ep=2)),
    ("mixtral", dict(tp=2, ep=2)),
    ("mixtral", dict(cp=2)),
    ("qwen3_moe", dict(ep=4)),
    ("qwen3_moe", dict(tp=2)),
    ("qwen3_moe", dict(tp=2, ep=2)),
]


@pytest.mark.parametrize("arch,layout", LAYOUTS, ids=[f"{a}-{'-'.join(f'{k}{v}' for k, v in layout.items())}"
                                                       for a, layout in LAYOUTS])
def test_parallel_layout_equals_single_rank(arch, layout, tiny_checkpoint, single_rank):
    folder, _ = tiny_checkpoint(arch)
    expected = single_rank(arch)
    with LLM(str(folder), dtype="float32", block_size=8, **layout) as llm:
        methods = record_cp_methods(llm) if layout.get("cp", 1) > 1 else []
        got = run_with_logits(llm)
    if layout.get("cp", 1) > 1:  # which method each prefill used: forced, or auto's choice (Meta's rule: a
        # full prefill passes KV; a partial one with a low miss rate, 22/54 and 7/55 here, passes Q)
        assert [(new, cached) for new, cached, _ in methods] == [(7, 0), (33, 0), (50, 0), (22, 32), (7, 48)]
        chosen = [layout.get("cp_method") or ("pass_q" if cached else "pass_kv") for _, cached, _ in methods]
        assert [method for _, _, method in methods] == chosen
    assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in expected]
    assert [cached for _, _, cached in got] == [cached for _, _, cached in expected]
    assert got[-1][2] > 0, "the second call must reuse a cached prefix (partial prefill)"
    for (_, ours, _), (_, ref, _) in zip(got, expected):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(cp=2)], ids=["tp2", "cp2"])
def test_smollm2_parallel_equals_single_rank_on_a_2000_token_prompt(layout, smollm2_llm):
    prompt = "The history of the city begins with a small village by the river. " * 150  # ~2,100 tokens
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    run = smollm2_llm.engine.run_model  # the session's engine: put back after
    try:
        reference = capture_logits(smollm2_llm)
        (expected,) = smollm2_llm.generate([prompt], params)
    finally:
        smollm2_llm.engine.run_model = run
    assert len(expected.prompt_token_ids) > 2000
    with LLM("smollm2-135m", dtype="float32", **layout) as llm:
        captured = capture_logits(llm)
        (got,) = llm.generate([prompt], params)
        # SmolLM2 has 9 query heads and 3 KV heads: TP 2 splits them 4/5 and replicates KV head 1
        short = llm.generate(["The capital of France is"], params)[0]
    assert got.token_ids == expected.token_ids
    torch.testing.assert_close(torch.stack(captured[got.request_id]), torch.stack(reference[expected.request_id]),
                               atol=2e-4, rtol=0)  # measured: under 2.3e-5 for both layouts
    assert short.token_ids == smollm2_llm.generate(["The capital of France is"], params)[0].token_ids


def test_cp_holds_a_prompt_that_one_ranks_cache_cannot(tiny_checkpoint):
    """Each CP rank stores only its blocks: two ranks of 8 blocks serve a prompt of 13 blocks."""
    folder, _ = tiny_checkpoint("llama")
    prompt = torch.randint(3, TINY_VOCAB, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    one_rank = LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=8)
    with pytest.raises(ValueError, match="prompt has 100 tokens; max_model_len is 64"):
        one_rank.generate([prompt], GREEDY)
    reference = LLM(str(folder), dtype="float32", block_size=8)
    expected_logits = capture_logits(reference)
    (expected,) = reference.generate([prompt], GREEDY)
    with LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=8, cp=2) as llm:
        captured = capture_logits(llm)
        (got,) = llm.generate([prompt], GREEDY)
        assert llm.engine.executor.kv_cache[0][0].shape[0] == 8  # rank 0 allocated its 8 blocks, no more
        blocks = llm.engine.blocks
        cached = [sum(1 for b, h in enumerate(blocks.hash_of) if h is not None and b % 2 == rank) for rank in (0, 1)]
    assert got.token_ids == expected.token_ids
    torch.testing.assert_close(torch.stack(captured[got.request_id]), torch.stack(expected_logits[expected.request_id]),
                               atol=1e-4, rtol=0)
    assert blocks.num_blocks == 16 and sum(cached) == 13  # the full blocks of the prompt and answer,
    assert all(0 < n <= 8 for n in cached)  # spread over both ranks
