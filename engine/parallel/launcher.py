"""Run one engine instance over N local ranks: this process is rank 0, ranks 1..N-1 are child processes.

Children are fresh interpreters (`python -m engine.parallel.launcher`), so the
caller's `__main__` is never re-imported (no `if __name__ == "__main__"` needed).
They read what to run from the rendezvous store.

Rank 0 owns the scheduler and the sampler. Every step it broadcasts the
`StepPlan` and runs its own share of the model; the other ranks receive the
plan, run theirs, and wait for the next one (`None` stops them). Plans travel
on a group of their own (`plan_group`) whose timeout is a year: an instance may
sit idle for any time, while the model's collectives keep the short one.

Failure: a rank that raises writes its traceback to the rendezvous store under
`error/<rank>` and exits; its closed connections make rank 0's next collective
fail at once, and rank 0 raises `ParallelError` with that rank's message. Rank 0
then stops every child. Children die with their parent (they set PR_SET_PDEATHSIG
first thing), so no rank outlives the instance even when rank 0 is killed.
"""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
import time
import traceback
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from engine.parallel.context import ParallelConfig, ParallelContext, connect
from engine.parallel.groups import IDLE, stateless_group
from engine.parallel.lifetime import die_with_parent
from engine.step_plan import StepPlan

HOST = "127.0.0.1"


class ParallelError(RuntimeError):
    """A rank of a parallel instance failed; the message names it and carries its error."""


def plan_group(store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
    """The group step plans are broadcast on (every rank creates it, after its ParallelContext);
    a follower waits for the next plan as long as the instance stays idle."""
    return stateless_group(store, "plans", rank, world_size, idle_timeout=IDLE)


def send_plan(group: dist.ProcessGroup, plan: StepPlan | None) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8)
    group.broadcast(torch.tensor([payload.numel()]), 0).wait()
    group.broadcast(payload, 0).wait()


def receive_plan(group: dist.ProcessGroup) -> StepPlan | None:
    size = torch.zeros(1, dtype=torch.long)
    group.broadcast(size, 0).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(payload, 0).wait()
    return pickle.loads(payload.numpy().tobytes())


class RankGroup:
    """Starts ranks 1..N-1 running `follower(rank, store, config, timeout, *follower_args)`; this process is rank 0."""

    def __init__(self, config: ParallelConfig, follower: Callable, follower_args: tuple, *,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120)) -> None:
        self.config, self.timeout = config, timeout
        world = config.world_size
        self.store = dist.TCPStore(HOST, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        threads = max(1, (os.cpu_count() or 1) // world)
        self.store.set("follower", pickle.dumps((follower, follower_args, config, threads, timeout)))
        # No preexec_fn: Popen can then vfork/exec without running fork handlers in this process (a forked
        # child of a process with gRPC threads can break its pollers). The child sets PDEATHSIG itself.
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "engine.parallel.launcher", str(self.store.port), str(rank),
                              str(os.getpid())])
            for rank in range(1, world)
        ]
        self._finalizer = weakref.finalize(self, _stop, self.processes)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        self.context: ParallelContext | None = None
        self.plans: dist.ProcessGroup | None = None

    def connect(self) -> ParallelContext:
        """Wait until every child is up (failing fast if one dies), then form the groups."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        keys = [f"ready/{rank}" for rank in range(1, self.config.world_size)]
        while not self.store.check(keys):
            if any(p.poll() is not None for p in self.processes) or time.monotonic() > deadline:
                raise self.failure(TimeoutError("ranks did not start in time"))
            time.sleep(0.05)
        self.context = connect(self.store, 0, self.config, timeout=self.timeout)
        self.plans = plan_group(self.store, 0, self.config.world_size)
        return self.context

    def failure(self, cause: BaseException) -> ParallelError:
        """Stop every child and say which rank failed and why (or rank 0's own error)."""
        deadline = time.monotonic() + 2  # a failing child exits right after writing its error
        for p in self.processes:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        errors, tracebacks = [], []
        for rank, p in enumerate(self.processes, start=1):
            if self.store.check([f"error/{rank}"]):
                text = self.store.get(f"error/{rank}").decode().strip()
                errors.append(f"rank {rank} failed: {text.splitlines()[-1]}")
                tracebacks.append(f"--- rank {rank} ---\n{text}")
            elif p.returncode not in (None, 0):
                errors.append(f"rank {rank} exited with code {p.returncode}")
        self.close()
        return ParallelError("\n".join(errors + tracebacks) or f"rank 0 failed: {cause!r}")

    def close(self) -> None:
        """Stop the children (asking them first when the group is healthy); safe to call twice."""
        if self.context is not None and all(p.poll() is None for p in self.processes):
            try:
                send_plan(self.plans, None)
                for p in self.processes:
                    p.wait(timeout=10)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        self.context = None
        self._finalizer()
        torch.set_num_threads(self._threads_before)


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _follower_main(port: int, rank: int, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    follower, follower_args, config, threads, timeout = pickle.loads(store.get("follower"))
    torch.set_num_threads(threads)
    try:
        follower(rank, store, config, timeout, *follower_args)
    except BaseException:
        store.set(f"error/{rank}", traceback.format_exc())
        os._exit(1)


if __name__ == "__main__":
    _follower_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
