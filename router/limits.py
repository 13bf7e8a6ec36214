"""What the router refuses before any instance sees a request, as pure functions over the model's card.

`fit(ids, sampling, vocab_size, max_model_len)` checks the prompt (not empty, every id in the vocabulary,
shorter than the context) and the generation budget (a `max_tokens` that was given must fit in the
context beside the prompt, as vLLM requires; an unset one is the default cut to the room left), and
returns the sampling message the request runs with. Refusals are `RequestError`s (INVALID_ARGUMENT)
naming the field and the limit.
"""

from __future__ import annotations

from engine.errors import RequestError
from protos.convert import DEFAULT_MAX_TOKENS
from protos.infermesh.v1 import common_pb2


def fit(ids: list[int], sampling: common_pb2.SamplingParams, vocab_size: int,
        max_model_len: int) -> common_pb2.SamplingParams:
    if not ids:
        raise RequestError("prompt must not be empty", param="prompt")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {ids[bad]} (at {bad}) is out of range [0, {vocab_size})", param="prompt")
    room = max_model_len - len(ids)
    if room < 1:
        raise RequestError(f"prompt has {len(ids)} tokens; max_model_len is {max_model_len} "
                           "(the prompt must leave room for at least one generated token)", param="prompt")
    bad = next((t for t in sampling.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"stop_token_ids: {bad} is out of range [0, {vocab_size})", param="stop_token_ids")
    fitted = common_pb2.SamplingParams()
    fitted.CopyFrom(sampling)
    if not sampling.HasField("max_tokens"):
        fitted.max_tokens = min(DEFAULT_MAX_TOKENS, room)
    elif sampling.max_tokens > room:
        raise RequestError(f"max_tokens is {sampling.max_tokens} and the prompt has {len(ids)} tokens: together "
                           f"{sampling.max_tokens + len(ids)}, over max_model_len {max_model_len}", param="max_tokens")
    return fitted
