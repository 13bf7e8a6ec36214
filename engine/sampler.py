"""Batched sampling (the parameters a request gives are `engine.sampling_params`).

Each row of a step's logits (in the model's dtype) belongs to one sequence with its own
`SamplingParams`. Greedy rows take the argmax as they are (the same index as in float32: up-casting is
exact and keeps the order), on CPU from the kernels' `argmax_rows` (at [32, 49152] in bf16 0.19 ms against
torch's `max` 1.18).
Other rows are up-cast to float32, scaled by temperature, filtered by
top-k and top-p, and drawn by inverse CDF from one uniform number per row; a row
whose request has a seed draws that number from its own generator, so the same
seed gives the same tokens whatever else shares the batch.

Log-probabilities are those of the model's distribution (before temperature and
filtering), computed only for rows that ask for them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.kernels import cpu_ops
from engine.sampling_params import SamplingParams, TokenLogprobs


def sample(
    logits: torch.Tensor,  # [N, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    tokens = _first_maxima(logits)  # [N]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        probs = _filtered_probs(logits[rows].float(), [params[i] for i in random_rows])  # [R, V]
        uniform = torch.stack([
            torch.rand((), generator=generators[i] or default_generator) for i in random_rows
        ]).to(probs.device)
        cdf = probs.cumsum(-1)  # [R, V]
        drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1)
        tokens[rows] = drawn.clamp_(max=logits.shape[-1] - 1)
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, token_list, params)


def _first_maxima(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index, as argmax gives it (torch's `max`: a quarter of argmax's time)."""
    if logits.dim() == 2 and logits.is_contiguous() and cpu_ops.takes(logits):
        return cpu_ops.ops().argmax_rows(logits)
    return logits.max(dim=-1).indices


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    logits = logits / temps
    top_ks = [p.top_k for p in params]
    if any(top_ks):
        k = torch.tensor([k if k else logits.shape[-1] for k in top_ks], device=logits.device)
        ranks = (k - 1).clamp(max=logits.shape[-1] - 1)[:, None]  # [R, 1]
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, ranks)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_ps = torch.tensor([p.top_p for p in params], device=logits.device)
    if bool((top_ps < 1).any()):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly better tokens
        drop_sorted = before >= top_ps[:, None]  # keeps the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs


def _logprobs(logits: torch.Tensor, tokens: list[int], params: Sequence[SamplingParams]) -> list[TokenLogprobs | None]:
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not wanted:
        return out
    logp = torch.log_softmax(logits[wanted].float(), dim=-1)  # [W, V]
    for row, i in enumerate(wanted):
        n = params[i].logprobs
        top = torch.topk(logp[row], n) if n else None
        out[i] = TokenLogprobs(
            tokens[i],
            float(logp[row, tokens[i]]),
            tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else (),
        )
    return out
