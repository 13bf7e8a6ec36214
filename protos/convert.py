"""Between wire messages and plain values (no engine import: services pass the result on).

Unset optional fields take the defaults (`top_p` 1.0; `max_tokens` the caller's, `engine.limits`); a value
that is set is passed on, so a bad one is refused by name. `temperature` 0 (unset) is greedy.
"""

from __future__ import annotations

from protos.infermesh.v1 import common_pb2

FINISH_REASONS = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
                  "abort": common_pb2.FINISH_REASON_ABORT}


def sampling_kwargs(msg: common_pb2.SamplingParams, default_max_tokens: int) -> dict:
    """Keyword arguments for the engine's SamplingParams."""
    return dict(max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
                temperature=msg.temperature, top_p=msg.top_p if msg.HasField("top_p") else 1.0,
                top_k=msg.top_k, seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
                stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
                logprobs=msg.logprobs if msg.HasField("logprobs") else None)


def sampling_message(params) -> common_pb2.SamplingParams:
    """From any object with the engine SamplingParams' fields."""
    return common_pb2.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                     top_k=params.top_k, seed=params.seed, stop=list(params.stop),
                                     stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                                     logprobs=params.logprobs)


def logprobs_fields(message: common_pb2.TokenLogprobs) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """The fields of the engine's TokenLogprobs (token_id, logprob, top), from a message."""
    return (message.chosen.token_id, message.chosen.logprob, tuple((t.token_id, t.logprob) for t in message.top))


def logprobs_message(lp) -> common_pb2.TokenLogprobs:
    """From the engine's TokenLogprobs (token_id, logprob, top: [(id, logprob)])."""
    return common_pb2.TokenLogprobs(chosen=common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob),
                                    top=[common_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top])
