"""Whether the CPU computes in bf16 itself: AVX512-BF16 or AMX tiles (x86). Where it does not (AVX2 machines:
AMD Zen 2/3, Intel before Cooper Lake; Arm, not measured), torch converts every operand of a bf16 GEMM — on an
AVX2 Zen 3 it ran at 19 GFLOP/s against 154-166 in float32 — so there the engine's `Linear` multiplies more than
32 bf16 rows (a prompt) in float32 and rounds the result to bf16 once, and `Int8Linear` past its kernel's rows
likewise. Decode steps take the few-row kernel, which sums bf16 weights in float32 FMAs anyway.
"""

from __future__ import annotations

import functools
import platform

import torch


def emulated(x: torch.Tensor) -> bool:
    """Whether `x` is bf16 on a CPU that converts it for every GEMM."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not cpu_computes_bf16()


@functools.cache
def cpu_computes_bf16() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
