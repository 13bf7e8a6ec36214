"""Sampler: greedy, temperature, top-k, top-p, seeds, logprobs; parameter validation."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import sample
from engine.sampling_params import SamplingParams, SamplingParamsError


def logits_rows(n: int = 1, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw_many(row: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    g = torch.Generator().manual_seed(0)
    return {sample(row[None], [params], [g])[0][0] for _ in range(n)}


def test_greedy_takes_the_argmax():
    logits = logits_rows(4)
    tokens, _ = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_only_draws_from_the_k_best():
    row = logits_rows()[0]
    drawn = draw_many(row, SamplingParams(temperature=5.0, top_k=3))
    assert drawn <= set(torch.topk(row, 3).indices.tolist()) and len(drawn) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert draw_many(row, SamplingParams(temperature=1.0, top_p=0.7)) == {0, 1}
    assert draw_many(row, SamplingParams(temperature=1.0, top_p=0.5)) == {0}


def test_same_seed_same_tokens_whatever_the_batch():
    logits = logits_rows(3, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def tokens_of_row0(batch_params):
        gens = [torch.Generator().manual_seed(42)] + [None] * (len(batch_params) - 1)
        return [sample(logits[: len(batch_params)], batch_params, gens, torch.Generator().manual_seed(i))[0][0]
                for i in range(1)]

    alone = tokens_of_row0([seeded])
    crowded = tokens_of_row0([seeded, SamplingParams(temperature=2.0), SamplingParams(temperature=0.5)])
    assert alone == crowded


def test_temperature_sampling_follows_the_distribution():
    row = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(row[None], [SamplingParams(temperature=1.0)], [g])[0][0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_logprobs_are_the_models_log_softmax():
    logits = logits_rows()
    tokens, lps = sample(logits, [SamplingParams(temperature=0, logprobs=3)], [None])
    ref = torch.log_softmax(logits[0], -1)
    assert lps[0].token_id == tokens[0]
    assert lps[0].logprob == pytest.approx(ref[tokens[0]].item(), abs=1e-6)
    assert [t for t, _ in lps[0].top] == torch.topk(ref, 3).indices.tolist()


def test_bf16_logits_sample_what_their_float32_copy_samples():
    """The model hands the sampler logits in its own dtype: greedy rows (ties included: the first maximal
    index), seeded draws and logprobs are those of the float32 copy."""
    logits = logits_rows(4, vocab=300, seed=3).bfloat16()  # bf16's coarse steps: ties among the best
    logits[0, 7] = logits[0, 250] = logits[0].max() + 1  # an exact tie for the first row's best
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, seed=1, logprobs=2), SamplingParams(temperature=1.3, top_k=20, top_p=0.9)]

    def run(rows):
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        return sample(rows, params, gens, torch.Generator().manual_seed(9))

    (tokens, lps), (want_tokens, want_lps) = run(logits), run(logits.float())
    assert tokens == want_tokens and tokens[0] == 7
    assert lps == want_lps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_argmax_kernel_gives_torchs_first_maximal_index(dtype):
    """Greedy rows on CPU take the kernels' `argmax_rows`: torch.max's index in every case torch defines:
    ties (the first), a NaN (the first NaN), rows of -inf, +inf, rows shorter and longer than a vector."""
    from engine.kernels import cpu_ops

    g = torch.Generator().manual_seed(0)
    for vocab in (1, 5, 16, 17, 1000, 49157):
        for rows in (1, 3, 32):
            ties = torch.randint(-3, 4, (rows, vocab), generator=g).to(dtype)
            plain = torch.randn(rows, vocab, generator=g).to(dtype)
            nans = plain.clone()
            nans[0, vocab // 2] = nans[0, -1] = nans[-1, 0] = float("nan")
            infinite = plain.clone()
            infinite[-1, -1] = float("inf")
            for logits in (ties, plain, nans, infinite, torch.full((rows, vocab), float("-inf"), dtype=dtype)):
                assert torch.equal(cpu_ops.ops().argmax_rows(logits), logits.max(dim=-1).indices)
    assert sample(ties, [SamplingParams(temperature=0)] * rows, [None] * rows)[0] == ties.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"logprobs": 50}, r"logprobs must be in \[0, 20\]"),
    ({"stop": [""]}, "stop strings must not be empty"),
])
def test_bad_sampling_params_name_the_field_and_limit(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)
