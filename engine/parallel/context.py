"""Parallel layout of one engine instance: sizes (`ParallelConfig`) and this rank's view (`ParallelContext`).

Ranks are laid out TP-inner: rank = cp_rank * tp + tp_rank. Expert parallelism
runs over the same ranks as attention: `ep` is 1 or the instance's world size
(with tp = cp = 1 and ep > 1, attention is replicated on every rank and each
rank dispatches its share of the tokens). Naming: "axis" is a parallel
dimension (tp, cp, ep), "dim" a tensor dimension.

`ParallelConfig.check(model)` refuses layouts that do not fit the model and
names every factor involved; uneven head splits are fine (TP gives each rank a
contiguous range of query heads and the KV heads those need, replicating KV
heads when tp exceeds their count).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from engine.config import ModelConfig
from engine.parallel import control
from engine.parallel.allreduce import AllReduceThresholds
from engine.parallel.groups import DEFAULT_TIMEOUT, stateless_group


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertAttachment:
    """Where this instance's MoE experts live: an expert instance's attachment group (engine.parallel.expert_attach)."""

    address: str  # host:port of the expert instance's rendezvous store
    group: str  # the attachment's group name, given by the expert instance
    expert_ranks: int
    timeout_s: float = 30.0  # how long a step waits for the expert ranks before failing


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    ep: int = 1
    cp_method: str = "auto"  # "auto" (the paper's heuristic), "pass_kv" or "pass_q"
    # Inputs of the pass-KV/pass-Q heuristic: one rank's attention FLOP/s and the CP link's bytes/s.
    # The defaults are a CPU rank and loopback gloo; an H100 with NVLink is ~8e14 and ~4.5e11.
    cp_peak_flops: float = 1e11
    cp_bandwidth: float = 2e9
    all_reduce: AllReduceThresholds | None = None  # TP's flat/tree/ring crossovers; None: the device's default
    experts: ExpertAttachment | None = None  # MoE experts hosted by an expert instance instead of these ranks

    def __post_init__(self) -> None:
        if self.cp_method not in ("auto", "pass_kv", "pass_q"):
            raise ValueError(f"cp_method must be 'auto', 'pass_kv' or 'pass_q', got {self.cp_method!r}")
        for axis in ("tp", "cp", "ep"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} must be >= 1, got {getattr(self, axis)}")
        if self.tp > 1 and self.cp > 1:
            raise ValueError(f"tp={self.tp} with cp={self.cp} is not supported: context parallelism runs with tp=1")
        if self.ep > 1 and self.cp > 1:
            raise ValueError(f"ep={self.ep} with cp={self.cp} is not supported: expert parallelism runs with cp=1")
        if self.ep > 1 and self.tp > 1 and self.ep != self.tp:
            raise ValueError(f"ep={self.ep} must equal tp={self.tp} (experts are spread over the attention ranks)")
        if self.ep > 1 and self.experts is not None:
            raise ValueError(f"ep={self.ep} with attached experts: the experts live in the expert instance, use ep=1")

    @property
    def world_size(self) -> int:
        return max(self.tp * self.cp, self.ep)

    def check(self, model: ModelConfig) -> None:
        """Raise ValueError naming every factor that does not fit `model`."""
        problems = []
        if self.tp > model.num_heads:
            problems.append(f"tp={self.tp} exceeds num_heads={model.num_heads} (each rank needs a query head)")
        dense_layers = model.num_layers - len(model.moe_layers)
        if dense_layers and model.intermediate_size % self.tp:
            problems.append(f"intermediate_size={model.intermediate_size} is not divisible by tp={self.tp}")
        if self.tp > model.vocab_size:
            problems.append(f"tp={self.tp} exceeds vocab_size={model.vocab_size}")
        if self.experts is not None:
            if not model.is_moe:
                problems.append(f"attached experts need a mixture-of-experts model; {model.architecture} has none")
            elif self.experts.expert_ranks > model.num_experts:
                problems.append(f"the expert instance's {self.experts.expert_ranks} ranks exceed "
                                f"num_experts={model.num_experts}")
        elif self.ep > 1:
            if not model.is_moe:
                problems.append(f"ep={self.ep} needs a mixture-of-experts model; {model.architecture} has no experts")
            elif self.ep > model.num_experts:
                problems.append(f"ep={self.ep} exceeds num_experts={model.num_experts} (each rank needs an expert)")
        elif model.is_moe and model.moe_intermediate_size % self.tp:
            problems.append(f"moe_intermediate_size={model.moe_intermediate_size} is not divisible by tp={self.tp}")
        if problems:
            raise ValueError(f"parallel layout tp={self.tp} cp={self.cp} ep={self.ep} "
                             f"(world_size={self.world_size}) does not fit the model: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelContext:
    """This rank's coordinates and groups; a group is None where its axis has size 1."""

    config: ParallelConfig
    rank: int
    instance_group: dist.ProcessGroup | None = None  # all ranks of the instance
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    expert_group: dist.ProcessGroup | None = None  # with an expert instance (config.experts): ranks of both

    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tp

    @property
    def cp_rank(self) -> int:
        return self.rank // self.config.tp % self.config.cp

    @property
    def ep_rank(self) -> int:
        return self.rank if self.config.ep > 1 else 0


def connect(store: dist.Store | None, rank: int, config: ParallelConfig, *, backend: str = "gloo",
            timeout: datetime.timedelta = DEFAULT_TIMEOUT, host: str = "") -> ParallelContext:
    """Create this rank's groups over `store` (None for one rank); every rank of the instance must call it.
    With `config.experts`, also join the expert instance's attachment group (it blocks until all are there).
    `host`: the address this rank's connections bind ("": the one its host name resolves to).

    With the layouts `ParallelConfig` allows, every axis larger than 1 spans the whole
    instance, so the axis groups are the instance group itself.
    """
    experts = None
    if config.experts is not None:  # attention ranks first, then the expert instance's ranks
        attach = config.experts
        attach_timeout = datetime.timedelta(seconds=attach.timeout_s)
        experts = control.Store.connect(attach.address, attach_timeout).join(
            attach.group, rank, config.world_size + attach.expert_ranks, timeout=attach_timeout, host=host)
    if config.world_size == 1:
        return ParallelContext(config=config, rank=0, expert_group=experts)
    # connected on first use: formed eagerly with the ranks on one core, it failed to connect 3 of 22 times
    group = stateless_group(store, "world", rank, config.world_size, backend=backend, timeout=timeout, host=host,
                            lazy=True)
    return ParallelContext(config=config, rank=rank, instance_group=group,
                           tp_group=group if config.tp > 1 else None,
                           cp_group=group if config.cp > 1 else None,
                           ep_group=group if config.ep > 1 else None,
                           expert_group=experts)
