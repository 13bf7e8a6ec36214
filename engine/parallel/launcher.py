"""Run one engine instance over N ranks: this process is rank 0; ranks 1..L-1 are its child processes on
this host, and ranks L..N-1 (if any) join from other hosts.

Ranks are fresh interpreters (`python -m engine.parallel.launcher --join HOST:PORT --rank I`), so the
caller's `__main__` is never re-imported (no `if __name__ == "__main__"` needed). They read what to run
(a `control.Call`: `call(rank, store, host=...)`, with the instance's `parallel` config and `timeout_s`
among its arguments) from the rendezvous store that rank 0 hosts (`Rendezvous`), and bind their groups
and servers to the address they are given: nothing assumes that ranks share a host.

Rank 0 owns the scheduler and the sampler. Every step it broadcasts the
`StepPlan` and runs its own share of the model; the other ranks receive the
plan, run theirs, and wait for the next one (`None` stops them). Plans travel
in their wire form (`engine.step_plan.encode`)
on a group of their own (`plan_group`) whose timeout is a year: an instance may
sit idle for any time, while the model's collectives keep the short one.

Failure: a rank that raises writes its traceback to the rendezvous store
(`control.RANK_ERROR`) and exits; its closed connections make rank 0's next collective
fail at once, and rank 0 raises `ParallelError` with that rank's message. Rank 0
then stops every child. Children die with their parent (they set PR_SET_PDEATHSIG
first thing), so no local rank outlives the instance even when rank 0 is killed; a
remote rank's next collective fails instead, and it exits.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import step_plan
from engine.cpus import available_cores
from engine.parallel.context import ParallelConfig, ParallelContext, connect
from engine.parallel.control import FOLLOWER, RANK_ERROR, READY, Call, RankError, Store
from engine.parallel.groups import IDLE, stateless_group
from engine.parallel.lifetime import die_with_parent
from engine.step_plan import StepPlan


class ParallelError(RuntimeError):
    """A rank of a parallel instance failed; the message names it and carries its error."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """Where an instance's ranks meet. Rank 0 hosts the store on host:port (port 0: any free one) and binds
    its groups to `host`; the first `local_ranks` ranks run on this host (None: all of them), as child
    processes of rank 0; the others join from other hosts (`python -m engine.parallel.launcher --join
    HOST:PORT --rank I`, or `infermesh rank`)."""

    host: str = "127.0.0.1"
    port: int = 0
    local_ranks: int | None = None

    @classmethod
    def of(cls, settings) -> "Rendezvous":
        """From a service's settings (`host`, `rendezvous_port`, `local_ranks`)."""
        return cls(host=settings.host, port=settings.rendezvous_port, local_ranks=settings.local_ranks)


def plan_group(store: dist.Store, rank: int, world_size: int, host: str = "") -> dist.ProcessGroup:
    """The group step plans are broadcast on (every rank creates it, after its ParallelContext);
    a follower waits for the next plan as long as the instance stays idle."""
    return stateless_group(store, "plans", rank, world_size, idle_timeout=IDLE, host=host)


def send_plan(group: dist.ProcessGroup, plan: StepPlan | None) -> None:
    """Broadcast `plan` (None: stop) from rank 0: its size, then its bytes (none for None)."""
    encoded = b"" if plan is None else step_plan.encode(plan)
    group.broadcast(torch.tensor([len(encoded)]), 0).wait()
    if encoded:
        group.broadcast(torch.frombuffer(bytearray(encoded), dtype=torch.uint8), 0).wait()


def receive_plan(group: dist.ProcessGroup) -> StepPlan | None:
    size = torch.zeros(1, dtype=torch.long)
    group.broadcast(size, 0).wait()
    if not int(size):
        return None
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(payload, 0).wait()
    return step_plan.decode(payload.numpy().tobytes())


def spawn_rank(address: str, rank: int, host: str, threads: int, parent_pid: int | None) -> subprocess.Popen:
    """Rank `rank` as a fresh interpreter joining the store at `address`. No preexec_fn: Popen can then
    vfork/exec without running fork handlers in this process (a forked child of a process with gRPC threads
    can break its pollers); the child sets PDEATHSIG itself."""
    args = ["--join", address, "--rank", str(rank), "--host", host, "--threads", str(threads)]
    if parent_pid is not None:
        args += ["--parent", str(parent_pid)]
    return subprocess.Popen([sys.executable, "-m", "engine.parallel.launcher", *args])


START_S = 120.0  # the least time ranks get to start and join


class RankGroup:
    """Rank 0 (this process) of an instance: hosts the rendezvous, starts its local ranks 1..L-1, which run
    `follower(rank, store, host=their host)` with `parallel=config` and `timeout_s` added to its arguments,
    and waits for the rest to join."""

    def __init__(self, config: ParallelConfig, follower: Call, *,
                 rendezvous: Rendezvous = Rendezvous(), backend: str = "gloo",
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120)) -> None:
        self.config, self.timeout, self.host, self.backend = config, timeout, rendezvous.host, backend
        world = config.world_size
        local = world if rendezvous.local_ranks is None else rendezvous.local_ranks
        if not 1 <= local <= world:
            raise ValueError(f"local_ranks must be in [1, world_size={world}], got {local}")
        self.store = Store.host(rendezvous.host, rendezvous.port, timeout, world)
        self.address = self.store.address
        self.store.put(FOLLOWER, Call(follower.function, {**follower.kwargs, "parallel": config,
                                                          "timeout_s": timeout.total_seconds()}))
        threads = max(1, len(available_cores()) // local)  # the ranks of a host split its cores
        self.processes = {rank: spawn_rank(self.address, rank, rendezvous.host, threads, os.getpid())
                          for rank in range(1, local)}
        self._finalizer = weakref.finalize(self, _stop, list(self.processes.values()))
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        self.context: ParallelContext | None = None
        self.plans: dist.ProcessGroup | None = None

    def connect(self) -> ParallelContext:
        """Wait until every rank is up (failing fast if a local one dies), then form the groups. Starting a rank
        (an interpreter, torch, the weights) may take longer than a collective may wait: at least START_S."""
        deadline = time.monotonic() + max(self.timeout.total_seconds(), START_S)
        keys = [READY.key(rank) for rank in range(1, self.config.world_size)]
        while not self.store.has(*keys):
            if any(p.poll() is not None for p in self.processes.values()) or time.monotonic() > deadline:
                raise self.failure(TimeoutError("ranks did not start in time"))
            time.sleep(0.05)
        self.context = connect(self.store.raw, 0, self.config, timeout=self.timeout, host=self.host,
                               backend=self.backend)
        self.plans = plan_group(self.store.raw, 0, self.config.world_size, host=self.host)
        return self.context

    def failure(self, cause: BaseException) -> ParallelError:
        """Stop every local rank and say which rank failed and why (or rank 0's own error)."""
        deadline = time.monotonic() + 2  # a failing child exits right after writing its error
        for p in self.processes.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        errors, tracebacks = [], []
        for rank in range(1, self.config.world_size):
            p = self.processes.get(rank)
            if (error := self.store.peek(RANK_ERROR.key(rank))) is not None:
                text = error.traceback.strip()
                errors.append(f"rank {rank} failed: {text.splitlines()[-1]}")
                tracebacks.append(f"--- rank {rank} ---\n{text}")
            elif p is not None and p.returncode not in (None, 0):
                errors.append(f"rank {rank} exited with code {p.returncode}")
        self.close()
        return ParallelError("\n".join(errors + tracebacks) or f"rank 0 failed: {cause!r}")

    def close(self) -> None:
        """Stop the ranks (asking them first when the group is healthy: remote ones then exit too); safe twice."""
        if self.context is not None and all(p.poll() is None for p in self.processes.values()):
            try:
                send_plan(self.plans, None)
                for p in self.processes.values():
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


def run_rank(address: str, rank: int, host: str, threads: int, parent_pid: int | None = None,
             join_timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> None:
    """One follower rank's life: join the store at `address` (waiting up to `join_timeout` for rank 0, which
    may start later on another host), then run the instance's follower, binding its groups and servers to
    `host`. A failure is written to the store (rank 0 reports it) and ends the process with code 1."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    store = Store.connect(address, join_timeout)
    torch.set_num_threads(threads)
    try:
        store.get(FOLLOWER).resolve()(rank, store, host=host)
    except BaseException:
        store.put(RANK_ERROR.key(rank), RankError(rank, traceback.format_exc()))
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.parallel.launcher",
                                     description="Run one follower rank of a parallel instance.")
    parser.add_argument("--join", required=True, help="HOST:PORT of the instance's rendezvous (its rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="the address this rank binds")
    parser.add_argument("--threads", type=int, default=len(available_cores()))
    parser.add_argument("--parent", type=int, default=None, help="die with this process")
    args = parser.parse_args(argv)
    run_rank(args.join, args.rank, args.host, args.threads, args.parent)


if __name__ == "__main__":
    main()
