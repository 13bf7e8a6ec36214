"""Paged decode attention on CPU: the C++ kernel `cpu_paged_decode.cpp`, checked.

    out = paged_decode(q [B, Hq, D], k_cache, v_cache [blocks, block_size, Hkv, D],
                       block_tables [B, max_blocks], context_lens [B], scale, kv_head_map=None)  # [B, Hq, D]

It reads each sequence's keys and values straight from its blocks (no gather of the context every
layer), a KV head's rows once for all the query heads that share it, with float32 scores and sums, on
torch's intra-op threads. The result of a sequence does not depend on its batch or the thread count.
Built with the other CPU kernels (`cpu_ops`); where they cannot be, the engine attends with torch.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.cpu_ops import ops
from engine.kernels.decode_checks import check_decode_shapes


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, kv_head_map: torch.Tensor | None = None) -> torch.Tensor:
    check_decode_shapes(q, k_cache, v_cache, block_tables, context_lens, grouped=kv_head_map is None)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"query {q.dtype} and caches {k_cache.dtype} / {v_cache.dtype} must share a dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if kv_head_map is None:
        kv_head_map = gqa_heads(num_heads, num_kv_heads)
    elif kv_head_map.shape != (num_heads,) or not 0 <= kv_head_map.min() <= kv_head_map.max() < num_kv_heads:
        raise ValueError(f"kv_head_map must give each of {num_heads} query heads a KV head in [0, {num_kv_heads})")
    return ops().paged_decode(q.contiguous(), k_cache, v_cache, block_tables.long().contiguous(),
                               context_lens.int(), kv_head_map.long().contiguous(), scale)


@functools.cache
def gqa_heads(num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Plain GQA: query head h reads KV head h // (Hq / Hkv)."""
    return torch.arange(num_heads) // (num_heads // num_kv_heads)
