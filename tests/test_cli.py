"""`infermesh generate`, run as a user would: a subprocess of the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

INFERMESH = shutil.which("infermesh", path=os.path.dirname(sys.executable)) or "infermesh"


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([INFERMESH, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_json_reports_ids_usage_and_timings(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    proc = run("generate", "hello world", "--model", str(folder), "--max-tokens", "6", "--ignore-eos",
               "--dtype", "float32", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.rstrip("\n").split("\n")
    result = json.loads(lines[-1])
    assert set(result) == {"text", "token_ids", "prompt_token_ids", "finish_reason", "usage", "timings"}
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": len(result["prompt_token_ids"]), "completion_tokens": 6}
    assert proc.stdout.startswith(result["text"])  # the text was streamed before the JSON line
    assert set(result["timings"]) == {"ttft_s", "tokens_per_s"}


@pytest.mark.slow
def test_generate_over_two_tensor_parallel_ranks_gives_the_same_tokens(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    common = ("generate", "hello world", "--model", str(folder), "--max-tokens", "6", "--ignore-eos",
              "--dtype", "float32", "--json")
    single, parallel = run(*common), run(*common, "--tp", "2")
    assert parallel.returncode == 0, parallel.stderr
    tokens = [json.loads(r.stdout.splitlines()[-1])["token_ids"] for r in (single, parallel)]
    assert tokens[0] == tokens[1]


def test_a_layout_that_does_not_fit_exits_2_naming_the_factors(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    proc = run("generate", "hi", "--model", str(folder), "--tp", "5")
    assert proc.returncode == 2
    assert "tp=5 exceeds num_heads=4" in proc.stderr and "intermediate_size=96 is not divisible by tp=5" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "error: temperature must be >= 0, got -1.0"),
    (["--top-p", "0"], r"error: top_p must be in (0, 1], got 0.0"),
    (["--max-tokens", "0"], "error: max_tokens must be >= 1, got 0"),
    (["--max-tokens", "-1", "--target", "127.0.0.1:1"], "error: max_tokens must be >= 1, got -1"),  # before dialing
    (["--top-k", "-2", "--target", "127.0.0.1:1"], "error: top_k must be >= 0"),
    (["--top-k", "-2"], "error: top_k must be >= 0"),
    (["--model", "missing-model"], "error: unknown model 'missing-model'"),
    (["--dtype", "int8"], "error: dtype must be one of float32, bfloat16, float16, got 'int8'"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    proc = run("generate", "hi", *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.strip().startswith(message)


def test_empty_prompt_exits_2():
    proc = run("generate", "")
    assert proc.returncode == 2 and "prompt must not be empty" in proc.stderr


@pytest.mark.slow
def test_chat_on_smollm2_answers_paris():
    proc = run("generate", "What is the capital of France?", "--chat", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in json.loads(proc.stdout.splitlines()[-1])["text"]
