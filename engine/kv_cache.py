"""The paged KV cache: per layer, K and V as [num_blocks, block_size, kv_heads, head_dim].

Which blocks a sequence owns is the block manager's business (pure Python); this
module only sizes and allocates the tensors. Block ids index the first dimension.

A context-parallel instance of N ranks deals N times one rank's blocks: global
block g lives on rank g % N, as that rank's block g // N (`KVStripe`). So each
rank allocates only its share and the instance holds N times one rank's KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.config import ModelConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class KVStripe:
    """The global blocks one rank stores: g with g % size == rank, as its local block g // size."""

    rank: int = 0
    size: int = 1

    def stores(self, block: int) -> bool:
        return block % self.size == self.rank

    def local(self, block: int) -> int:
        return block // self.size


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    heads = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()


def num_blocks_for(cfg: ModelConfig, block_size: int, dtype: torch.dtype, cache_bytes: int,
                   num_kv_heads: int | None = None) -> int:
    return max(1, cache_bytes // bytes_per_block(cfg, block_size, dtype, num_kv_heads))


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu", num_kv_heads: int | None = None,
                      memory: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> KVCache:
    """`memory(shape, dtype)`: where the cache lives, a zeroed tensor (default: torch.zeros on `device`)."""
    heads = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    shape = (num_blocks, block_size, heads, cfg.head_dim)
    zeros = memory or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
    return [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(cfg.num_layers)]
