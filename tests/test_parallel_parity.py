"""A parallel engine (TP, CP, EP, TP×EP over real gloo rank processes) gives exactly what one rank gives.

Each layout runs the same two calls as a single-rank engine: a continuous batch of
prompts of 1, 7, 33 and 50 tokens (lengths not divisible by 2N, a prompt shorter
than 2N chunks), then prompts that extend the first ones, so their cached prefix is
reused (partial prefill). Greedy tokens must be identical and the logits of every
step within 1e-4 (fp32).
"""

from __future__ import annotations

import functools

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import TINY_VOCAB
from tests.test_parity_tiny import capture_logits

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
        got = run_with_logits(llm)
    assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in expected]
    assert [cached for _, _, cached in got] == [cached for _, _, cached in expected]
    assert got[-1][2] > 0, "the second call must reuse a cached prefix (partial prefill)"
    for (_, ours, _), (_, ref, _) in zip(got, expected):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(cp=2)], ids=["tp2", "cp2"])
def test_smollm2_parallel_equals_single_rank_on_a_2000_token_prompt(layout, smollm2_llm):
    prompt = "The history of the city begins with a small village by the river. " * 150  # ~2,100 tokens
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (expected,) = smollm2_llm.generate([prompt], params)
    assert len(expected.prompt_token_ids) > 2000
    with LLM("smollm2-135m", dtype="float32", **layout) as llm:
        (got,) = llm.generate([prompt], params)
        # SmolLM2 has 9 query heads and 3 KV heads: TP 2 splits them 4/5 and replicates KV head 1
        short = llm.generate(["The capital of France is"], params)[0]
    assert got.token_ids == expected.token_ids
    assert short.token_ids == smollm2_llm.generate(["The capital of France is"], params)[0].token_ids
