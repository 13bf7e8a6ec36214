"""Cores lent between the engine processes of a host, one decode step at a time.

`infermesh up` gives each engine instance cores of its own (`engine.cpus`): two OpenMP teams on the same
cores wait on each other's preempted threads at every barrier. But a prefill instance's cores then sit idle
between prompts while decode runs every step on its own share alone: at a 6,000-token context a decode
instance beside a CP=2 prefill instance on two cores decoded at 0.60-0.69 (AVX2) and 0.74-0.82 (Zen 4) of the
in-process rate; lent prefill's core, at 0.88-0.96 (Zen 4).

So cores are lent. An engine process that has cores of its own (an owner) holds them while it works and
lets go when it idles; a decode instance may borrow idle cores for one step, running that step on as many
more intra-op threads. A borrowed core is back with its owner at the end of the borrower's step in hand:
only decode borrows, whose steps mostly take milliseconds (one that prefills a prompt on decode, a short one
or one whose prefill failed, takes longer; a prefill chunk borrowing decode's core would hold decode's next
token for a second).

Each core has two lock files in /dev/shm (`flock`: the kernel drops a process's locks when it dies, so a
killed owner or borrower leaves no core held), named by core and user:
- `.want`: an owner about to work holds it shared; a borrower that finds it held takes nothing, so an
  owner waits for one step at most, never for a borrower that keeps taking the core back (and for `WAIT_S`
  at most: a borrower stopped or hung mid-step shares the core until its step ends, it does not stall it);
- `.lock`: owners hold it shared while they work (instances that `infermesh up` scaled past its plan share
  cores); a borrower holds it exclusively during its step.
The files stay (empty): removing a lock file another process has open would give the next one a new file
and two holders.

`CpuLending(own, borrowable)`: `work()` before stepping after an idle spell (waits for a borrower's step to
end), `idle()` before waiting for work, `borrow()` before a step (the cores it took), `give_back()` after it.
Plain syscalls, no torch: the engine's loop runs the step on the cores (`engine.loop`).
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Sequence

from engine.cpus import parse_cpus

LOCK_DIR = "/dev/shm"
WAIT_S = 2.0  # an owner's longest wait for a borrower's step (decode steps take milliseconds, a prefill on decode ~1 s)


def from_flags(cpus: str, borrow_cpus: str = "") -> "CpuLending | None":
    """An engine instance's lending, from its `--cpus` and `--borrow-cpus` core lists (no cores of its own: none)."""
    return CpuLending(parse_cpus(cpus), parse_cpus(borrow_cpus) if borrow_cpus else ()) if cpus else None


def lock_paths(core: int, directory: str = LOCK_DIR) -> tuple[str, str]:
    """The core's `.want` and `.lock` files for this user."""
    stem = os.path.join(directory, f"infermesh-cpu{core}-{os.getuid()}")
    return f"{stem}.want", f"{stem}.lock"


class CpuLending:
    def __init__(self, own: Sequence[int], borrowable: Sequence[int] = (), directory: str = LOCK_DIR) -> None:
        """`own`: this process's cores; `borrowable`: cores of others it may borrow for a step (its own are
        left out)."""
        self.own = sorted(set(own))
        self._own = [self._open(core, directory) for core in self.own]
        self._borrowable = {core: self._open(core, directory) for core in sorted(set(borrowable) - set(own))}
        self._working = False
        self._borrowed: dict[int, int] = {}  # core -> its `.lock` descriptor, held this step

    @staticmethod
    def _open(core: int, directory: str) -> tuple[int, int]:
        return tuple(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                     for path in lock_paths(core, directory))

    def work(self, wait_s: float = WAIT_S) -> None:
        """Hold this process's cores (no-op while held): waits while a borrower's step runs on them, for
        `wait_s` at most (a borrower stuck mid-step, stopped or hung, is shared with, not waited for)."""
        if self._working:
            return
        for want, _ in self._own:
            fcntl.flock(want, fcntl.LOCK_SH)  # from here no borrower takes the cores again
        deadline = time.monotonic() + wait_s
        for _, lock in self._own:
            while not _try(lock, fcntl.LOCK_SH) and time.monotonic() < deadline:
                time.sleep(0.001)
        self._working = True

    def idle(self) -> None:
        """Let go of this process's cores (no-op while not held)."""
        if not self._working:
            return
        for want, lock in self._own:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(want, fcntl.LOCK_UN)
        self._working = False

    def borrow(self) -> list[int]:
        """Take the borrowable cores no owner works on or waits for, until `give_back()`; which."""
        for core, (want, lock) in self._borrowable.items():
            if not _try(want):  # an owner works there, or is about to
                continue
            fcntl.flock(want, fcntl.LOCK_UN)
            if _try(lock):
                self._borrowed[core] = lock
        return list(self._borrowed)

    def give_back(self) -> None:
        for lock in self._borrowed.values():
            fcntl.flock(lock, fcntl.LOCK_UN)
        self._borrowed.clear()

    def close(self) -> None:
        self.give_back()
        self.idle()
        for fd in (fd for pair in self._own + list(self._borrowable.values()) for fd in pair):
            os.close(fd)
        self._own, self._borrowable = [], {}


def _try(fd: int, kind: int = fcntl.LOCK_EX) -> bool:
    """A lock of `kind` on `fd` if no one holds one that excludes it."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
