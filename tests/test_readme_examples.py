"""The README's OpenAI-compatible examples work as written: its `curl` command and its `openai` program,
run against `infermesh up` serving SmolLM2 (float32, so the greedy answer does not hang on bf16 rounding);
only the port differs from the README's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_mesh_processes import start_mesh, started, stop_mesh

README = (Path(__file__).parents[1] / "README.md").read_text()


def example(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README, re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


@pytest.mark.slow
def test_the_readme_curl_and_openai_examples_run_against_up():
    proc, address = start_mesh("smollm2-135m", "--http-port", "0", "--prefill", "0")
    ready = started(address)
    (router,) = [i for i in ready if i["role"] == "router"]
    port = router["http_address"].rsplit(":", 1)[1]
    try:
        curl = example("bash", "curl -s http://localhost:8001").replace("8001", port)
        answer = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120).stdout)
        assert "Paris" in answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] > 0
        program = example("python", "OpenAI(base_url=").replace("8001", port)
        run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert len(run.stdout.split()) > 5  # a streamed answer of several words
    finally:
        stop_mesh(proc, [i["pid"] for i in ready])
