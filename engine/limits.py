"""What every prompt must be, and what an unset `max_tokens` means: pure functions (no torch) that the engine
and the router's two faces share, so a request is judged the same wherever it is checked.

`check_prompt` refuses an empty prompt, a token id outside the vocabulary, and a prompt that leaves no room
for one generated token; it returns the room left. `max_tokens_for` is the one place an unset `max_tokens`
gets its value: the face's default (the gRPC API and the CLI: `DEFAULT_MAX_TOKENS`; OpenAI completions: 16;
OpenAI chat: none, the rest of the context), cut to the room left. A `max_tokens` that was given must fit
beside the prompt (as vLLM requires). Refusals are `RequestError`s naming the field and the limit.
"""

from __future__ import annotations

from typing import Sequence

from engine.errors import RequestError

DEFAULT_MAX_TOKENS = 256  # an unset max_tokens on the gRPC API, the CLI and internal requests


def check_prompt(ids: Sequence[int], vocab_size: int, max_model_len: int) -> int:
    """The tokens left for generation after the prompt `ids` (>= 1), or RequestError naming what is wrong."""
    if not ids:
        raise RequestError("prompt must not be empty", param="prompt")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {ids[bad]} (at {bad}) is out of range [0, {vocab_size})", param="prompt")
    room = max_model_len - len(ids)
    if room < 1:
        raise RequestError(f"prompt has {len(ids)} tokens; max_model_len is {max_model_len} "
                           "(the prompt must leave room for at least one generated token)", param="prompt")
    return room


def max_tokens_for(given: int | None, prompt_tokens: int, room: int,
                   default: int | None = DEFAULT_MAX_TOKENS) -> int:
    """The tokens a request may generate: `given`, if it fits in the `room` the prompt leaves; unset, `default`
    cut to the room (None: all of it)."""
    if given is None:
        return room if default is None else min(default, room)
    if given > room:
        raise RequestError(f"max_tokens is {given} and the prompt has {prompt_tokens} tokens: together "
                           f"{given + prompt_tokens}, over max_model_len {room + prompt_tokens}", param="max_tokens")
    return given
