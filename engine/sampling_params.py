"""Sampling parameters: what a request asks of the sampler, validated on construction. Plain Python: no
torch, so the router checks a request's parameters before any instance sees them.

Bad values raise `SamplingParamsError` (a `RequestError`) naming the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import RequestError

MAX_STOP_STRINGS = 16  # a request's stop strings: at most this many ...
MAX_STOP_CHARS = 256  # ... of at most this many characters each (every token is matched against them)


class SamplingParamsError(RequestError):
    """A sampling parameter out of its range; the message names it."""


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
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if not self.temperature >= 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}", param="temperature")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0 (0 disables it), got {self.top_k}", param="top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be in [0, 20], got {self.logprobs}", param="logprobs")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must not be empty", param="stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}", param="stop")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise SamplingParamsError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {longest}",
                                      param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())  # (token id, logprob), best first
