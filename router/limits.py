"""What the router refuses before any instance sees a request, as a pure function over the model's card.

`fit(ids, sampling, vocab_size, max_model_len, default_max_tokens)` checks the prompt and the generation
budget (`engine.limits`: the rules the engine applies too) and the stop token ids, and returns the sampling
message the request runs with, its `max_tokens` always set. Refusals are `RequestError`s (INVALID_ARGUMENT)
naming the field and the limit.
"""

from __future__ import annotations

from engine.errors import RequestError
from engine.limits import DEFAULT_MAX_TOKENS, check_prompt, max_tokens_for
from protos.infermesh.v1 import common_pb2


def fit(ids: list[int], sampling: common_pb2.SamplingParams, vocab_size: int, max_model_len: int,
        default_max_tokens: int | None = DEFAULT_MAX_TOKENS) -> common_pb2.SamplingParams:
    """`default_max_tokens`: the face's default for an unset `max_tokens` (None: the rest of the context)."""
    room = check_prompt(ids, vocab_size, max_model_len)
    bad = next((t for t in sampling.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"stop_token_ids: {bad} is out of range [0, {vocab_size})", param="stop_token_ids")
    fitted = common_pb2.SamplingParams()
    fitted.CopyFrom(sampling)
    fitted.max_tokens = max_tokens_for(sampling.max_tokens if sampling.HasField("max_tokens") else None, len(ids),
                                       room, default_max_tokens)
    return fitted
