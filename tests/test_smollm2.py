"""SmolLM2-135M-Instruct (the bundled GGUF) against transformers loading the same file."""

from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams

pytestmark = pytest.mark.slow


def test_32_greedy_tokens_match_transformers(smollm2_llm, smollm2_hf):
    prompt = smollm2_llm.tokenizer.encode("The history of the Roman Empire")
    (out,) = smollm2_llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    ref = smollm2_hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=2)
    assert out.token_ids == ref.sequences[0, len(prompt):].tolist()


def test_prefill_logits_close_to_transformers(smollm2_llm, smollm2_hf):
    prompt = smollm2_llm.tokenizer.encode("Paris is the capital of")
    (out,) = smollm2_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    with torch.no_grad():
        ref = torch.log_softmax(smollm2_hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    top = out.logprobs[0].top
    assert [t for t, _ in top] == torch.topk(ref, 5).indices.tolist()
    for token, logprob in top:
        assert abs(logprob - ref[token].item()) < 1e-3


def test_chat_answers_paris(smollm2_llm):
    (out,) = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                              SamplingParams(max_tokens=40, temperature=0.0))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_chat_template_matches_transformers(smollm2_llm, smollm2_hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    ref = smollm2_hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert smollm2_llm.tokenizer.encode_chat(messages) == list(ref)


def varied_strings(n: int = 240) -> list[str]:
    rng = random.Random(1234)
    pieces = ["Hello", "world", " ", "  ", "\t", "\n", "\n\n", "   ", "12345", "3.14159", "-42", "1,000,000",
              "0x1F", "naïve", "café", "Ünïcödé", "日本語", "中文字符", "한국어", "Привет", "مرحبا", "שלום",
              "😀", "🚀🔥",
              "👨‍👩‍👧", "def f(x):", "    return x*2", "{\"a\": [1, 2]}", "<html>", "a_b-c.d", "!!!", "...", "—",
              "can't", "I'm", "you'll", "http://example.com/?q=1", "#include <stdio.h>", "SELECT * FROM t;",
              "  leading", "trailing  ", "MiXeD CaSe", "ALLCAPS", "tab\tsep", "e=mc^2", "∑∫√∞", "½ ¾", "$100.00"]
    fixed = [p for p in pieces] + ["", " ", "a", "\u00a0", "x" * 100, "1 2 3 4", "  1", "a  1", "12 345 6789"]
    out = list(fixed)
    while len(out) < n:
        out.append("".join(rng.choice(pieces) + rng.choice(["", " ", "  ", "\n"]) for _ in range(rng.randint(1, 8))))
    return out


def test_tokenizer_matches_transformers_on_varied_strings(smollm2_llm, smollm2_hf_tokenizer):
    strings = varied_strings()
    assert len(strings) >= 200
    for s in strings:
        ours = smollm2_llm.tokenizer.encode(s)
        assert ours == smollm2_hf_tokenizer.encode(s), s
        assert smollm2_llm.tokenizer.decode(ours) == s, s


def test_special_tokens_encode_to_their_ids(smollm2_llm):
    assert smollm2_llm.tokenizer.encode("<|im_start|>user") [0] == 1
    assert smollm2_llm.tokenizer.eos_token_ids == (2,)


def test_bfloat16_engine_answers_paris_too():
    from engine import LLM

    llm = LLM("smollm2-135m", dtype="bfloat16")
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=40, temperature=0.0))
    assert "Paris" in out.text
