"""The OpenAI HTTP API's shapes, as pure functions: request bodies in (checked field by field), response
bodies, stream chunks and error bodies out. No I/O; `router.http` serves them.

Requests: `/v1/completions` (`prompt`: a string, token ids, or a list of either) and
`/v1/chat/completions` (`messages` with string content or a list of text parts); `model`,
`max_tokens` / `max_completion_tokens`, `temperature` (default 1), `top_p`, `top_k` (extension), `seed`,
`stop`, `n`, `logprobs` (completions: top-n; chat: a flag with `top_logprobs`), `stream`,
`stream_options.include_usage`, `ignore_eos` (extension). Fields that would change the answer and
that the engine does not implement (penalties, logit bias, echo, best_of, tools, a non-text response
format) are refused by name rather than ignored. With `n` > 1 and a `seed`, choice i draws with seed + i.

Errors: one table from failure type to HTTP status and OpenAI error type (`HTTP_STATUSES`), the same
types the gRPC face maps to status codes.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import (
    Cancelled,
    DeadlineExceeded,
    KVCacheFull,
    NoReservation,
    Overloaded,
    RequestError,
    ServingError,
    Unauthenticated,
    Unavailable,
    UnknownModel,
    Unsupported,
)
from protos.infermesh.v1 import common_pb2, inference_pb2

MAX_N = 16
MAX_UINT32 = 2**32 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context's end
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None,
               "echo": False, "suffix": None, "tools": None, "functions": None, "min_tokens": 0}

HTTP_STATUSES: dict[type[ServingError], tuple[int, str]] = {  # type -> (status, OpenAI error type)
    RequestError: (400, "invalid_request_error"),
    Unsupported: (400, "invalid_request_error"),
    Unauthenticated: (401, "authentication_error"),
    UnknownModel: (404, "not_found_error"),
    NoReservation: (404, "not_found_error"),
    Overloaded: (429, "rate_limit_error"),
    KVCacheFull: (429, "rate_limit_error"),
    Cancelled: (499, "cancelled"),
    Unavailable: (503, "service_unavailable"),
    DeadlineExceeded: (504, "timeout"),
}


@dataclass(frozen=True, slots=True)
class Job:
    """What one HTTP request asks: prompts (each a text, token ids or chat messages), `n` choices per prompt."""

    model: str
    prompts: tuple  # completions: str | list[int]; chat: one list of (role, content)
    sampling: common_pb2.SamplingParams
    n: int
    stream: bool
    include_usage: bool
    chat: bool
    default_max_tokens: int | None  # for an unset max_tokens: completions OpenAI's 16, chat the rest of the context

    def choice_sampling(self, index: int) -> common_pb2.SamplingParams:
        """Choice `index` of a prompt: the same parameters, its own seed when one was given."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.sampling)
        if sampling.HasField("seed"):
            sampling.seed = (sampling.seed + index) % 2**64
        return sampling


def http_status(error: ServingError) -> tuple[int, str]:
    for kind in type(error).__mro__:
        if kind in HTTP_STATUSES:
            return HTTP_STATUSES[kind]
    return 500, "server_error"


def error_body(error: ServingError) -> tuple[int, dict]:
    status, kind = http_status(error)
    code = "model_not_found" if isinstance(error, UnknownModel) else None
    return status, {"error": {"message": str(error), "type": kind, "param": error.param, "code": code}}


# ---- requests ------------------------------------------------------------------------------


def parse_completion(body: object) -> Job:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts: tuple = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        prompts = tuple(prompt)
    else:
        raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of either",
                           param="prompt")
    logprobs = _int(body, "logprobs", 0, 20)
    return _job(body, prompts, chat=False, logprobs=logprobs,
                max_tokens=_int(body, "max_tokens", 1, MAX_UINT32))


def parse_chat(body: object) -> Job:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    pairs = [(_role(m, i), _text_content(m, i)) for i, m in enumerate(messages)]
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not want:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", 1, MAX_UINT32)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, MAX_UINT32)
    return _job(body, (pairs,), chat=True, logprobs=(top or 0) if want else None, max_tokens=max_tokens)


def _job(body: dict, prompts: tuple, *, chat: bool, logprobs: int | None, max_tokens: int | None) -> Job:
    for name, default in UNSUPPORTED.items():
        if body.get(name) not in (None, default, {}, []):
            raise RequestError(f"{name} is not supported by this server (got {body[name]!r})", param=name)
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n"):
        raise RequestError("best_of is not supported by this server", param="best_of")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise RequestError("response_format: only {'type': 'text'} is supported", param="response_format")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings", param="stop")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    sampling = common_pb2.SamplingParams(
        temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0, MAX_UINT32, 0), stop=stops, ignore_eos=_bool(body, "ignore_eos", False))
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if (seed := _int(body, "seed", 0, 2**64 - 1)) is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    model = body.get("model", "")
    if not isinstance(model, str):
        raise RequestError("model must be a string", param="model")
    return Job(model=model, prompts=prompts, sampling=sampling, n=_int(body, "n", 1, MAX_N, 1),
               stream=_bool(body, "stream", False), include_usage=_bool(options or {}, "include_usage", False),
               chat=chat, default_max_tokens=None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _int(body: dict, name: str, low: int, high: int, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {value}", param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name} must be a number, got {value!r}", param=name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _role(message: object, i: int) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
    return message["role"]


def _text_content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content[{j}] must be a text part "
                                   "({'type': 'text', 'text': ...}); other content is not supported", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


# ---- responses -----------------------------------------------------------------------------


@dataclass(slots=True)
class Choice:
    """One choice as it accumulates from the stream of `GenerateResponse`s."""

    index: int
    text: str = ""
    token_ids: list | None = None
    logprobs: list | None = None  # [common_pb2.TokenLogprobs]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
          common_pb2.FINISH_REASON_ABORT: "abort"}


def accumulate(choice: Choice, response: inference_pb2.GenerateResponse) -> None:
    if response.HasField("delta"):
        choice.text += response.delta.text
        choice.token_ids = (choice.token_ids or []) + list(response.delta.token_ids)
        if response.delta.logprobs:
            choice.logprobs = (choice.logprobs or []) + list(response.delta.logprobs)
    else:
        final = response.final
        choice.finish_reason = FINISH.get(final.finish_reason)
        choice.prompt_tokens, choice.completion_tokens = final.usage.prompt_tokens, final.usage.completion_tokens


def usage(choices: list[Choice], prompts: int, n: int) -> dict:
    """Prompt tokens counted once per prompt (not per choice), completion tokens over every choice."""
    prompt_tokens = sum(c.prompt_tokens for c in choices[::n]) if len(choices) == prompts * n else 0
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def completion_logprobs(logprobs: list, token_text, offset: int = 0) -> dict:
    """The completions API's logprobs object for some tokens; `token_text(id)` spells one token."""
    tokens = [token_text(lp.chosen.token_id) for lp in logprobs]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    tops = []
    for lp in logprobs:
        top: dict[str, float] = {}
        for t in lp.top:  # best first; tokens that spell the same text keep the best one's logprob
            top.setdefault(token_text(t.token_id), t.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.chosen.logprob for lp in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(logprobs: list, token_text) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(lp.chosen.token_id, lp.chosen.logprob)
                        | {"top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]} for lp in logprobs]}


def response_body(job: Job, request_id: str, created: int, choices: list[Choice], token_text) -> dict:
    body = {"id": request_id, "created": created, "model": job.model, "usage": usage(choices, len(job.prompts), job.n)}
    if job.chat:
        body["object"] = "chat.completion"
        body["choices"] = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "finish_reason": c.finish_reason,
                            "logprobs": chat_logprobs(c.logprobs or [], token_text)
                            if job.sampling.HasField("logprobs") else None} for c in choices]
    else:
        body["object"] = "text_completion"
        body["choices"] = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                            "logprobs": completion_logprobs(c.logprobs or [], token_text)
                            if job.sampling.HasField("logprobs") else None} for c in choices]
    return body


def chunk(job: Job, request_id: str, created: int, index: int, *, text: str | None = None, role: bool = False,
          finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    """One stream chunk of one choice: the role first (chat), then text deltas, then its finish reason."""
    if job.chat:
        delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": job.model, "choices": [choice]}


def usage_chunk(job: Job, request_id: str, created: int, choices: list[Choice]) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": created, "model": job.model, "choices": [],
            "usage": usage(choices, len(job.prompts), job.n)}
