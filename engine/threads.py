"""Where an engine process's intra-op threads run.

Across processes: `pin` gives this process the cores it was handed (`engine.cpus`: `infermesh up` hands
each engine instance of a host its own) and as many intra-op threads as there are of them.

Within a process: the engine's thread uses them all; every other thread that runs torch ops (a gRPC
handler writing pushed KV, a KV receiver thread) runs them on itself alone. Why: a second thread that
starts an OpenMP parallel region gets a team of its own, whose threads live as long as it does; libgomp
then manages more threads than there are cores, stops spinning at barriers, and every parallel op of the
engine's step pays to wake its team. Measured: batch-1 decode at 3,000 tokens of context went from 25.7 to 12.0
tok/s after one other (living) thread had copied a tensor with two threads, and a decode instance fed by a prefill
instance decoded at half the speed of one that prefilled itself. A thread's count is its own once it has used torch;
a new thread takes the count last set on any thread, so each sets its own: these threads one, the engine's loop its
instance's (`engine.loop.EngineLoop`).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from engine.cpus import available_cores, format_cpus, parse_cpus


def pin(cores: Sequence[int], borrowable: Sequence[int] = ()) -> None:
    """Run every thread of this process, and the processes it starts, on `cores` only, with one intra-op
    thread per core (the engine's thread runs a step on `borrowable` cores as well while their owners idle:
    engine.cpu_lending). ValueError if it may not use them all."""
    allowed = available_cores()
    if not cores or (set(cores) | set(borrowable)) - set(allowed):
        asked = f"cpus={format_cpus(cores)!r}" + (f", borrow_cpus={format_cpus(borrowable)!r}" if borrowable else "")
        raise ValueError(f"{asked}: this process may use only cores {format_cpus(allowed)}")
    for thread in os.listdir("/proc/self/task"):  # sched_setaffinity sets one thread's; threads made later inherit
        try:
            os.sched_setaffinity(int(thread), cores)
        except ProcessLookupError:  # it ended meanwhile
            pass
    torch.set_num_threads(len(cores))


def pin_cpus(cpus: str, borrow_cpus: str = "") -> None:
    """`pin` from an engine instance's `cpus` and `borrow_cpus` settings (core lists as text; "" cpus: every core
    the process may use, nothing to pin)."""
    if cpus:
        pin(parse_cpus(cpus), parse_cpus(borrow_cpus) if borrow_cpus else ())


def off_the_engine_thread() -> None:
    """Call first on a thread that is not the engine's and may run torch ops: they run on this thread only."""
    torch.set_num_threads(1)
