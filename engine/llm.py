"""The user-facing Python API, shaped like vLLM's offline `LLM`.

    llm = LLM("smollm2-135m", dtype="bfloat16")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0.0))
    for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=20)): print(delta.text, end="")

`generate` and `chat` run all their prompts together in one continuous batch.
With `tp=`, `cp=` or `ep=` above 1 the engine runs over that many local ranks
(this process is rank 0, the others are child processes); `close()` or a `with`
block stops them.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence, Union

from engine.core import EngineCore
from engine.engine_config import DEFAULTS as ENGINE
from engine.engine_config import EngineConfig
from engine.errors import RequestError
from engine.model_info import DEFAULT_MODEL
from engine.parallel.context import ExpertAttachment, ParallelConfig
from engine.sampling_params import SamplingParams, TokenLogprobs
from engine.weights import load_checkpoint

Prompt = Union[str, list[int]]
Messages = list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt_token_ids), "completion_tokens": len(self.token_ids),
                "cached_prompt_tokens": self.cached_prompt_tokens}

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first over the time after the first."""
        decode_s = self.total_s - self.ttft_s
        return (len(self.token_ids) - 1) / decode_s if decode_s > 0 and len(self.token_ids) > 1 else 0.0


@dataclass(frozen=True, slots=True)
class CompletionDelta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = ENGINE.dtype, device: str = ENGINE.device,
                 tp: int = 1, cp: int = 1, ep: int = 1, cp_method: str = "auto",
                 experts: ExpertAttachment | None = None,
                 **engine_options) -> None:
        """`experts`: run the MoE experts on an expert instance's ranks (see engine.parallel.expert_attach)."""
        config = EngineConfig(dtype=dtype, device=device, **engine_options)
        parallel = ParallelConfig(tp=tp, cp=cp, ep=ep, cp_method=cp_method, experts=experts)
        checkpoint = load_checkpoint(model, config.torch_dtype)
        self.engine = EngineCore(checkpoint, config, parallel)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the other ranks of a parallel engine (tp/cp/ep > 1); safe to call twice."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        batch = [prompts] if _is_single_prompt(prompts) else list(prompts)
        return self._run([self._tokenize(p) for p in batch], params)

    def chat(self, messages: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run([self.tokenizer.encode_chat(c) for c in conversations], params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[CompletionDelta]:
        """Deltas of one request as they are produced; the last carries the finish reason."""
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(request_id, self._tokenize(prompt), params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        reason = out.finish_reason.value if out.finish_reason else None
                        yield CompletionDelta(out.new_token_ids, out.text_delta, reason, out.new_logprobs)
                        if reason:
                            return
        finally:
            self.engine.abort(request_id)  # no-op once finished; frees blocks if the caller stopped early

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _run(self, prompts: list[list[int]], params) -> list[Completion]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        start = time.monotonic()
        ids = [f"req-{next(self._ids)}" for _ in prompts]
        seqs = {}
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                seqs[request_id] = self.engine.add_request(request_id, prompt, p)
            first_token: dict[str, float] = {}
            done: dict[str, float] = {}
            while len(done) < len(ids):
                for out in self.engine.step():
                    now = time.monotonic()
                    first_token.setdefault(out.request_id, now)
                    if out.finished:
                        done[out.request_id] = now
        finally:
            for request_id in ids:
                self.engine.abort(request_id)
        return [
            Completion(
                request_id=i, prompt_token_ids=seqs[i].prompt_token_ids, token_ids=seqs[i].output_token_ids,
                text=seqs[i].text, finish_reason=seqs[i].finish_reason.value,
                cached_prompt_tokens=seqs[i].num_cached_prompt_tokens,
                logprobs=seqs[i].logprobs if seqs[i].params.logprobs is not None else None,
                ttft_s=first_token[i] - start, total_s=done[i] - start,
            )
            for i in ids
        ]


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, list) and (not prompts or isinstance(prompts[0], int)))
