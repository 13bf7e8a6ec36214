"""Sum-all-reduce with three algorithms chosen by message size, after Meta's DDA.

- FLAT: every rank gathers every peer's buffer and reduces locally. One step, the
  most bytes (each rank receives (W-1) full buffers); best for small decode messages.
- TREE: reduce-scatter, then all-gather of the reduced shards. Ring's byte count in
  two steps; mid sizes.
- RING: the backend's own all_reduce; large messages.

Meta's thresholds on MI300X (flat <= 200 KB, tree <= 29 MB) are the defaults on
GPUs; on CPU/gloo the measured crossover (bench/parallel.py) is: flat up to
256 KB, then ring. Every algorithm
reduces in rank order where it reduces locally, so all ranks hold identical sums.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.parallel import shm_allreduce


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
            raise ValueError(f"need 0 <= flat_max_bytes ({self.flat_max_bytes}) "
                             f"<= tree_max_bytes ({self.tree_max_bytes})")


CPU = torch.device("cpu")
# Measured on gloo over loopback: flat wins up to ~256 KB, the backend ring above; tree never.
GLOO_THRESHOLDS = AllReduceThresholds(flat_max_bytes=256 * 1024, tree_max_bytes=256 * 1024)


def default_thresholds(device: torch.device) -> AllReduceThresholds:
    """Meta's DDA thresholds on GPUs; the measured gloo crossover on CPU."""
    return AllReduceThresholds() if device.type == "cuda" else GLOO_THRESHOLDS


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


class AllReducer:
    """`all_reduce` bound to a group (of ranks on one host), its thresholds and a device.

    Direct access where the hardware has it, as Meta's DDA: on CUDA with torch's
    symmetric memory, FLAT and TREE run as its one-shot and two-shot kernels over a
    buffer registered once (NVLink); on a CPU host, every message that fits the
    shared segment runs as FLAT through shared memory. Otherwise the gloo/NCCL
    algorithms above, chosen by the thresholds.
    """

    def __init__(self, group: dist.ProcessGroup, thresholds: AllReduceThresholds = AllReduceThresholds(),
                 device: torch.device = CPU, dtype: torch.dtype = torch.float32,
                 shared_memory: bool = True) -> None:
        self.group, self.thresholds = group, thresholds
        self.symmetric = _SymmetricBuffer.create(group, thresholds, device, dtype) if device.type == "cuda" else None
        use_shm = (shared_memory and device.type == "cpu" and group.size() > 1 and shm_allreduce.available()
                   and shm_allreduce.shares_memory(group))  # ranks on other hosts: gloo
        self.shared = shm_allreduce.SharedMemoryAllReduce(group) if use_shm else None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group.size() == 1:
            return tensor
        num_bytes = tensor.numel() * tensor.element_size()
        if self.shared is not None and num_bytes <= self.shared.max_bytes:
            return self.shared(tensor)
        algorithm = choose_algorithm(num_bytes, self.thresholds)
        symmetric = self.symmetric
        if symmetric is not None and algorithm is not AllReduceAlgorithm.RING and tensor.dtype == symmetric.dtype:
            return self.symmetric.all_reduce(tensor, algorithm)
        return all_reduce(tensor, self.group, algorithm)


@dataclass(frozen=True, slots=True)
class _SymmetricBuffer:
    name: str
    buffer: torch.Tensor  # symmetric memory, tree_max_bytes long
    dtype: torch.dtype

    @classmethod
    def create(cls, group, thresholds: AllReduceThresholds, device: torch.device, dtype: torch.dtype):
        """None when symmetric memory is not usable here (no NVLink P2P, an older torch): the caller falls back."""
        try:
            import torch.distributed._symmetric_memory as symm_mem
            from torch._C._distributed_c10d import _register_process_group

            name = f"infermesh-allreduce-{id(group)}"
            _register_process_group(name, group)  # symmetric memory finds its group by name
            numel = max(1, thresholds.tree_max_bytes // torch.tensor([], dtype=dtype).element_size())
            buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, name)
            return cls(name, buffer, dtype)
        except (ImportError, RuntimeError, AttributeError):
            return None

    def all_reduce(self, tensor: torch.Tensor, algorithm: AllReduceAlgorithm) -> torch.Tensor:
        staged = self.buffer[: tensor.numel()]
        staged.copy_(tensor.reshape(-1))
        if algorithm is AllReduceAlgorithm.FLAT:
            reduced = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.name)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.name)
            reduced = staged
        return tensor.copy_(reduced.view_as(tensor))
