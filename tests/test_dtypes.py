"""The default dtype, `auto`: bfloat16 where the CPU has bf16 arithmetic (its flags, as the kernel reports them),
float32 elsewhere; the engine builds its weights and KV cache in what it resolved to."""

from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig
from engine.dtypes import resolve_dtype, torch_dtype


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (x86: `flags`; Arm: `Features`)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_auto_is_bfloat16_exactly_where_the_cpu_has_bf16_arithmetic():
    x86_bf16 = {"avx512_bf16", "amx_bf16"} & cpu_flags() and "Features" not in Path("/proc/cpuinfo").read_text()
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if x86_bf16 else "float32")
    assert EngineConfig().torch_dtype == torch_dtype("auto") == getattr(torch, resolve_dtype("auto", "cpu"))


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_kept_on_any_device(name):
    assert resolve_dtype(name, "cpu") == resolve_dtype(name, "cuda") == name


def test_an_unknown_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, got 'int8'"):
        EngineConfig(dtype="int8")


def test_the_engine_computes_in_what_auto_resolved_to(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    with LLM(str(folder)) as llm:
        runner, want = llm.engine.executor, torch_dtype("auto")
        assert {p.dtype for p in runner.model.parameters()} == {want}
        assert runner.kv_cache[0][0].dtype == want
        assert llm.generate("hello world")[0].token_ids  # and it serves
