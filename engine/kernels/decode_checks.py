"""The shape checks every paged decode attention kernel makes of its inputs (Triton's on CUDA, C++ on CPU).

    check_decode_shapes(q [B, Hq, D], k_cache, v_cache [blocks, block_size, Hkv, D], block_tables [B, ...],
                        context_lens [B], grouped=True)

ValueError naming the input and the shape it must have. `grouped`: query heads map to KV heads in plain
GQA groups (Hq a multiple of Hkv); without it a head map says which KV head each query head reads.
"""

from __future__ import annotations

import torch


def check_decode_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, grouped: bool = True) -> None:
    batch, num_heads, head_dim = q.shape
    _, _, num_kv_heads, kv_dim = k_cache.shape
    if k_cache.shape != v_cache.shape or kv_dim != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         f"[blocks, block_size, kv_heads, {head_dim}]")
    if grouped and num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must have {batch} rows")
