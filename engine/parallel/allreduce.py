"""Sum-all-reduce with three algorithms chosen by message size, after Meta's DDA.

- FLAT: every rank gathers every peer's buffer and reduces locally. One step, the
  most bytes (each rank receives (W-1) full buffers); best for small decode messages.
- TREE: reduce-scatter, then all-gather of the reduced shards. Ring's byte count in
  two steps; mid sizes.
- RING: the backend's own all_reduce; large messages.

Meta's thresholds on MI300X (flat <= 200 KB, tree <= 29 MB) are the defaults; the
crossover on a given machine is measured by bench/parallel.py. Every algorithm
reduces in rank order where it reduces locally, so all ranks hold identical sums.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist


class AllReduceAlgorithm(enum.Enum):
    FLAT = "flat"
    TREE = "tree"
    RING = "ring"


@dataclass(frozen=True, kw_only=True, slots=True)
class AllReduceThresholds:
    flat_max_bytes: int = 200 * 1024
    tree_max_bytes: int = 29 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 <= self.flat_max_bytes <= self.tree_max_bytes:
            raise ValueError(f"need 0 <= flat_max_bytes ({self.flat_max_bytes}) <= tree_max_bytes ({self.tree_max_bytes})")


def choose_algorithm(num_bytes: int, thresholds: AllReduceThresholds = AllReduceThresholds()) -> AllReduceAlgorithm:
    if num_bytes <= thresholds.flat_max_bytes:
        return AllReduceAlgorithm.FLAT
    if num_bytes <= thresholds.tree_max_bytes:
        return AllReduceAlgorithm.TREE
    return AllReduceAlgorithm.RING


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, algorithm: AllReduceAlgorithm | None = None,
               thresholds: AllReduceThresholds = AllReduceThresholds()) -> torch.Tensor:
    """Sum `tensor` over `group`, in place; returns it."""
    world = group.size()
    if world == 1:
        return tensor
    algorithm = algorithm or choose_algorithm(tensor.numel() * tensor.element_size(), thresholds)
    flat = tensor.contiguous().view(-1)
    if algorithm is AllReduceAlgorithm.FLAT:
        gathered = flat.new_empty(world * flat.numel())
        group._allgather_base(gathered, flat).wait()
        reduced = gathered.view(world, -1).sum(0)  # [W, n] -> [n]
    elif algorithm is AllReduceAlgorithm.TREE:
        shard = -(-flat.numel() // world)
        padded = torch.nn.functional.pad(flat, (0, shard * world - flat.numel()))  # [W * shard]
        mine = flat.new_empty(shard)
        group._reduce_scatter_base(mine, padded).wait()
        gathered = flat.new_empty(shard * world)
        group._allgather_base(gathered, mine).wait()
        reduced = gathered[: flat.numel()]
    else:
        group.allreduce([flat]).wait()
        reduced = flat
    if reduced.data_ptr() != tensor.data_ptr():
        tensor.copy_(reduced.view_as(tensor))
    return tensor
