"""Engine behaviour on a tiny checkpoint: streaming, stop conditions, seeds, aborts, bad input."""

from __future__ import annotations

import json

import pytest

from engine import LLM, RequestError, SamplingParams
from engine.config import ConfigError
from engine.weights import WeightsError


def copy_files(src, dst, names=("config.json", "tokenizer.json")) -> None:
    for name in names:
        (dst / name).write_text((src / name).read_text())


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    return LLM(str(folder), dtype="float32")


def test_stream_yields_one_token_at_a_time_and_ends_with_the_reason(llm):
    deltas = list(llm.stream([5, 6, 7], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))
    assert len(deltas) == 10 and all(len(d.token_ids) == 1 for d in deltas)
    assert [d.finish_reason for d in deltas] == [None] * 9 + ["length"]
    (whole,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text


def test_abandoned_stream_frees_its_blocks(llm):
    stream = llm.stream([5, 6, 7], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    next(stream)
    assert llm.engine.blocks.num_used_blocks > 0
    stream.close()
    assert llm.engine.blocks.num_used_blocks == 0 and not llm.engine.has_unfinished()


def test_stop_token_ids_end_generation_and_are_returned(llm):
    (free,) = llm.generate([[9, 9, 9]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stop_at = free.token_ids[4]
    (out,) = llm.generate([[9, 9, 9]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"


def test_stop_strings_truncate_the_text_and_never_stream_past_it(llm):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    (free,) = llm.generate([[11, 12]], params)
    stop = free.text[len(free.text) // 2:][:3]
    assert stop.strip(), "need visible text to stop on"
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    (out,) = llm.generate([[11, 12]], p)
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]
    streamed = "".join(d.text for d in llm.stream([11, 12], p))
    assert streamed == out.text


def test_seeded_sampling_repeats_and_ignores_batch_neighbours(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    (a,) = llm.generate([[3, 4]], seeded)
    b, _ = llm.generate([[3, 4], [8, 8, 8, 8]], [seeded, SamplingParams(max_tokens=16, temperature=1.0)])
    assert a.token_ids == b.token_ids


def test_max_tokens_and_usage(llm):
    (out,) = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.usage == {"prompt_tokens": 4, "completion_tokens": 5, "cached_prompt_tokens": 0}


def test_generation_stops_at_the_model_context(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    small = LLM(str(folder), dtype="float32", max_model_len=20)
    (out,) = small.generate([list(range(3, 18))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_text_prompts_and_chat_use_the_tokenizer(llm):
    (out,) = llm.generate("hello world", SamplingParams(max_tokens=3, temperature=0))
    assert out.prompt_token_ids == llm.tokenizer.encode("hello world")
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0))
    assert chat.prompt_token_ids == llm.tokenizer.encode("<s>user: hi</s><s>assistant: ", add_special_tokens=False)


# ---- bad input: a clear error naming the field and the limit -----------------------------

def test_empty_prompt_is_refused(llm):
    with pytest.raises(RequestError, match="prompt must not be empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(RequestError, match="prompt must not be empty"):
        llm.generate([[]], SamplingParams())


def test_prompt_longer_than_the_context_is_refused(llm):
    limit = llm.engine.max_model_len
    with pytest.raises(RequestError, match=f"prompt has {limit} tokens; max_model_len is {limit}"):
        llm.generate([[5] * limit], SamplingParams())
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_used_blocks == 0


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(RequestError, match=r"prompt token id 99999 \(at 1\) is out of range \[0, 320\)"):
        llm.generate([[1, 99999]], SamplingParams())


def test_unknown_model_name_is_refused():
    with pytest.raises(WeightsError, match="unknown model 'no-such-model'"):
        LLM("no-such-model")


def test_missing_weight_files_are_refused(tmp_path, tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    copy_files(folder, tmp_path, ["config.json"])
    with pytest.raises(WeightsError, match="has no \\*.safetensors weight files"):
        LLM(str(tmp_path))


def test_corrupted_weight_files_are_refused(tmp_path, tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    copy_files(folder, tmp_path)
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(WeightsError, match="cannot read .*model.safetensors"):
        LLM(str(tmp_path))


def test_corrupted_gguf_is_refused(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(WeightsError, match="cannot read GGUF file"):
        LLM(str(bad))


def test_unsupported_architecture_is_refused(tmp_path, tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported; supported: llama, mistral"):
        LLM(str(tmp_path))


def test_a_checkpoint_missing_a_tensor_is_refused(tmp_path, tiny_checkpoint):
    from safetensors.torch import load_file, save_file

    folder, _ = tiny_checkpoint("llama")
    copy_files(folder, tmp_path)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="missing weight 'model.layers.1.mlp.up_proj.weight'"):
        LLM(str(tmp_path))
