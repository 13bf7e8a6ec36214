"""Resuming a request on another engine (what a migration does): given the tokens it already generated,
the engine continues exactly where the first one was: the same tokens (greedy, and seeded sampling from
the right draw), and text deltas that start where the streamed text ended, stop-string text held back
included; a resume that cannot continue is refused by name and leaves nothing behind."""

from __future__ import annotations

import pytest

from engine.core import EngineConfig, EngineCore
from engine.errors import RequestError
from engine.sampling_params import SamplingParams
from engine.weights import load_checkpoint


def run(engine: EngineCore, request_id: str, prompt: list[int], params: SamplingParams, resume: tuple = ()):
    """Every (token ids, text delta) the request yields until it finishes."""
    engine.add_request(request_id, prompt, params, resume_token_ids=resume)
    deltas = []
    while engine.has_unfinished():
        deltas += [(out.new_token_ids, out.text_delta, out.finish_reason) for out in engine.step()
                   if out.request_id == request_id]
    return deltas


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    return load_checkpoint(str(folder))


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True, stop=("zz", "the q")),
], ids=["greedy", "seeded", "seeded-with-stop-strings"])
def test_a_resumed_request_continues_where_the_first_engine_was(checkpoint, params):
    prompt = [5, 9, 33, 2 + 40, 17]
    whole = run(EngineCore(checkpoint, EngineConfig(dtype="float32")), "first", prompt, params)
    tokens = [t for ids, _, _ in whole for t in ids]
    for cut in (1, 7, len(tokens) - 1):  # the first instance died after `cut` tokens had been streamed
        streamed_text = "".join(text for _, text, _ in whole[:cut])
        rest = run(EngineCore(checkpoint, EngineConfig(dtype="float32")), "second", prompt, params,
                   tuple(tokens[:cut]))
        assert [t for ids, _, _ in rest for t in ids] == tokens[cut:]
        assert streamed_text + "".join(text for _, text, _ in rest) == "".join(text for _, text, _ in whole)
        assert rest[-1][2] == whole[-1][2]


def test_a_resume_that_cannot_continue_is_refused_and_leaves_nothing(checkpoint):
    engine = EngineCore(checkpoint, EngineConfig(dtype="float32"))
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(RequestError, match=r"resume_token_ids\[2\] ends the request already"):
        engine.add_request("r", [5, 6], params, resume_token_ids=(7, 8, 9))  # max_tokens reached
    with pytest.raises(RequestError, match=r"resume_token_ids\[0\]=999 is out of range \[0, 320\)"):
        engine.add_request("r", [5, 6], params, resume_token_ids=(999,))
    assert not engine.has_unfinished() and engine.blocks.num_used_blocks == 0
    assert engine.add_request("r", [5, 6], params, resume_token_ids=(7,)).num_tokens == 3  # the id is free again
