"""The engine's dtypes by name, and what `auto` (the default) picks: bfloat16 where the hardware computes in
it — CUDA devices that support it, x86 CPUs with AVX512-BF16 or AMX tiles — and float32 everywhere else.

A CPU without bf16 arithmetic (AVX2 machines: AMD Zen 2/3, Intel before Cooper Lake; Arm, not measured)
makes torch convert every bf16 operand: on an AVX2 AMD Zen 3 its bf16 matmul ran at 19 GFLOP/s against
154-166 in float32, and the engine prefilled 75 tokens/s in bf16 against 376 in float32 (bench/RESULTS.md,
"a CPU without bf16 arithmetic"). bf16 still reads half the bytes, so one stream decodes faster in it
there (29.8 against 17.0 tokens/s): pick it by name for that. `auto` resolves on each host; give prefill, decode and expert instances
on different kinds of CPU one dtype explicitly (KV and hidden states cross between them in it).
"""

from __future__ import annotations

import platform

import torch

DTYPES_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = ("auto", *DTYPES_BY_NAME)


def computes_bf16(device: str) -> bool:
    """Whether `device` ("cpu", "cuda", "cuda:N") has bf16 arithmetic of its own."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(name: str, device: str) -> str:
    """`name` itself, or for "auto" the dtype this device computes fastest in (module docstring)."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    if name != "auto":
        return name
    return "bfloat16" if computes_bf16(device) else "float32"


def torch_dtype(name: str, device: str = "cpu") -> torch.dtype:
    return DTYPES_BY_NAME[resolve_dtype(name, device)]
