"""Prefill attention on CPU: the C++ kernel `cpu_prefill_attention.cpp`, checked.

    out, lse = prefill_attention(q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, D], scale, causal=True,
                                 kv_head_map=None)  # [n, Hq, D] in q's dtype, [n, Hq] float32

Causal: the queries are the context's last n tokens (a chunk after a cached prefix sees the whole prefix).
Flash-attention style on torch's intra-op threads: float32 scores and sums, bf16 products on AVX512-BF16
dot products where the CPU has them (torch's CPU kernel runs bf16 no faster than float32). `takes` says
whether the kernel runs on a head size; where it does not, or the kernels are not built, the engine
attends with torch's SDPA.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import cpu_ops
from engine.kernels.cpu_decode import gqa_heads

HEAD_DIMS = (16, 32, 64, 128)


def takes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the engine attends these inputs with the kernel: bf16 where the CPU has its dot products (there
    2.3x torch's SDPA at 2,048 tokens); elsewhere torch's SDPA, not slower (float32: 39.5
    against the kernel's 48 ms; AMX CPUs, where torch's own kernel takes AMX tiles: not measured)."""
    return takes_heads(q.dtype, q.shape[-1]) and cpu_ops.takes(q, k)


def takes_heads(dtype: torch.dtype, head_dim: int) -> bool:
    """`takes` for heads of this dtype and size (on CPU, with the kernels built)."""
    return dtype == torch.bfloat16 and head_dim in HEAD_DIMS and cpu_ops.available() and _bf16_dot()


@functools.cache
def _bf16_dot() -> bool:
    """Whether bf16 products take AVX512-BF16 dot products here (not AMX tiles, not float32 FMAs)."""
    return cpu_ops.ops().linear_path(torch.bfloat16) == "dot"


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True,
                      kv_head_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if kv_head_map is None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        kv_head_map = gqa_heads(num_heads, num_kv_heads)
    q, k, v = (_dense_rows(t) for t in (q, k, v))
    if k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    return cpu_ops.ops().prefill_attention(q, k, v, kv_head_map.long().contiguous(), scale, causal)


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """t [rows, H, D] with each row's heads dense (any row stride: a view of a fused projection is fine)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()
