"""Run step plans over a local group of ranks: rank 0 here, followers in child processes.

`ParallelExecutor.execute(plan)` has the same contract as `ModelRunner.execute`:
the logits of the sampled rows, on rank 0. Followers load the checkpoint from its
source themselves, shard it for their rank and follow the broadcast plans.
"""

from __future__ import annotations

import datetime
from typing import Callable

import torch

from engine.kv_cache import KVStripe
from engine.parallel.context import ParallelConfig, connect
from engine.parallel.control import READY, Call, Ready, Store
from engine.parallel.launcher import ParallelError, RankGroup, Rendezvous, plan_group, receive_plan, send_plan
from engine.parallel.parallelize import build_runner
from engine.step_plan import StepPlan
from engine.weights import Checkpoint, load_checkpoint


class ParallelExecutor:
    def __init__(self, checkpoint: Checkpoint, parallel: ParallelConfig, *, dtype: torch.dtype, device: str,
                 block_size: int, num_blocks: int, quantization: str = "none", kv_memory: Callable | None = None,
                 follower_hook: Call | None = None, rendezvous: Rendezvous = Rendezvous(),
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120), batch_invariant: bool = True) -> None:
        """`timeout`: how long a collective of the model may wait for a rank (idle waits have none).
        `kv_memory`: a module-level function (followers import it by name)."""
        layout = dict(device=device, block_size=block_size, num_blocks=num_blocks, quantization=quantization,
                      batch_invariant=batch_invariant)
        follower = Call.of(follow_plans, source=str(checkpoint.source), dtype=str(dtype).removeprefix("torch."),
                           layout=layout, kv_memory=kv_memory and Call.of(kv_memory), hook=follower_hook)
        self.ranks = RankGroup(parallel, follower, rendezvous=rendezvous, backend=backend_for(device), timeout=timeout)
        ctx = self.ranks.connect()
        try:
            self.runner = build_runner(checkpoint, ctx, dtype=dtype, kv_memory=kv_memory, **layout)
        except BaseException as e:
            raise self.ranks.failure(e) from e

    @property
    def store(self) -> Store:
        """The instance's rendezvous store, shared by all its ranks."""
        return self.ranks.store

    @property
    def kv_cache(self):
        return self.runner.kv_cache  # rank 0's share

    @property
    def kv_stripe(self) -> KVStripe:
        return self.runner.kv_stripe  # rank 0's

    @property
    def last_choices(self) -> list:
        return self.runner.last_choices

    def execute(self, plan: StepPlan, on_layer=None) -> torch.Tensor:
        """`on_layer` runs on rank 0 only; followers push their share from their follower hook."""
        if self.ranks.context is None:
            raise ParallelError("this parallel instance has stopped; create a new one")
        try:
            send_plan(self.ranks.plans, plan)
            return self.runner.execute(plan, on_layer)
        except BaseException as e:
            raise self.ranks.failure(e) from e

    def close(self) -> None:
        self.ranks.close()


def backend_for(device: str) -> str:
    """NCCL between CUDA ranks, gloo between CPU ones (step plans always travel on gloo)."""
    return "nccl" if device.startswith("cuda") else "gloo"


def follow_plans(rank: int, store: Store, *, host: str, parallel: ParallelConfig, timeout_s: float, source: str,
                 dtype: str, layout: dict[str, str | int | bool], kv_memory: Call | None, hook: Call | None) -> None:
    """A follower rank's whole life: load, shard, then run every broadcast plan until `None`.
    `hook(rank, store, runner, host)` returns `before_step(plan)`, which may return an `on_layer` for that step;
    `host` is the address this rank binds."""
    checkpoint = load_checkpoint(source, getattr(torch, dtype))
    if layout["device"] == "cuda":  # the ranks of a host are consecutive: one GPU each
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store.put(READY.key(rank), Ready(rank))
    timeout = datetime.timedelta(seconds=timeout_s)
    ctx = connect(store.raw, rank, parallel, timeout=timeout, host=host, backend=backend_for(layout["device"]))
    plans = plan_group(store.raw, rank, parallel.world_size, host=host)
    runner = build_runner(checkpoint, ctx, dtype=getattr(torch, dtype),
                          kv_memory=kv_memory.resolve() if kv_memory else None, **layout)
    before_step = hook.resolve()(rank, store, runner, host) if hook is not None else None
    while (plan := receive_plan(plans)) is not None:
        on_layer = before_step(plan) if before_step is not None else None
        runner.execute(plan, on_layer)
