"""A child process's life tied to its parent's: the kernel kills it when the parent dies, even by SIGKILL.

Plain Python (no torch): rank processes of a parallel instance call it, and so does every service
process that `infermesh up` starts (`mesh.service`).
"""

from __future__ import annotations

import ctypes
import os
import signal


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to kill this process when its parent dies; exit now if it already has."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent still stops its children when it closes or exits
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
