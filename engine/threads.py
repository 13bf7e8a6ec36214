"""Intra-op threads in a process that hosts an engine: the engine's thread uses them all; every other thread
that runs torch ops (a gRPC handler writing pushed KV, a KV receiver thread) runs them on itself alone.

Why: a second thread that starts an OpenMP parallel region gets a team of its own, whose threads live as
long as it does; libgomp then manages more threads than there are cores, stops spinning at barriers, and
every parallel op of the engine's step pays to wake its team. Measured: batch-1 decode at 3,000 tokens of
context went from 25.7 to 12.0 tok/s after one other (living) thread had copied a tensor with two threads,
and a decode instance fed by a prefill instance decoded at half the speed of one that prefilled itself
(bench/RESULTS.md, session 20). A thread's count is its own once it has used torch; a new thread takes
the count last set on any thread, so each sets its own: these threads one, the engine's loop its instance's
(`engine.loop.EngineLoop`).
"""

from __future__ import annotations

import torch


def off_the_engine_thread() -> None:
    """Call first on a thread that is not the engine's and may run torch ops: they run on this thread only."""
    torch.set_num_threads(1)
