"""Sampling parameters and batched sampling.

Each row of a step's logits belongs to one sequence with its own `SamplingParams`.
Greedy rows take the argmax. Other rows are scaled by temperature, filtered by
top-k and top-p, and drawn by inverse CDF from one uniform number per row; a row
whose request has a seed draws that number from its own generator, so the same
seed gives the same tokens whatever else shares the batch.

Log-probabilities are those of the model's distribution (before temperature and
filtering), computed only for rows that ask for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


class SamplingParamsError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top alternatives per token

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())  # (token id, logprob), best first


def sample(
    logits: torch.Tensor,  # [N, V] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    tokens = torch.argmax(logits, dim=-1)  # [N]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])  # [R, V]
        uniform = torch.stack([
            torch.rand((), generator=generators[i] or default_generator) for i in random_rows
        ]).to(probs.device)
        cdf = probs.cumsum(-1)  # [R, V]
        drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1)
        tokens[rows] = drawn.clamp_(max=logits.shape[-1] - 1)
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, token_list, params)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    logits = logits / temps
    top_ks = [p.top_k for p in params]
    if any(top_ks):
        k = torch.tensor([k if k else logits.shape[-1] for k in top_ks], device=logits.device)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1).clamp(max=logits.shape[-1] - 1)[:, None])
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
    logp = torch.log_softmax(logits[wanted], dim=-1)  # [W, V]
    for row, i in enumerate(wanted):
        n = params[i].logprobs
        top = torch.topk(logp[row], n) if n else None
        out[i] = TokenLogprobs(
            tokens[i],
            float(logp[row, tokens[i]]),
            tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else (),
        )
    return out
