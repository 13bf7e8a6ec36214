"""The processes `infermesh up` starts and keeps: started from an argv, restarted after a crash, stopped.

Each child runs `argv` with its output appended to its own log file. `watch()` (called every half second
by `infermesh up`) looks at each: one that exited 0 left cleanly (a drain) and is let go; one that exited
otherwise is started again with the same argv after the back-off `mesh.restarts` decides, or left down
once it has been restarted too often; every restart is counted (`on_restart`). A child left down stays in
the list (state DOWN, `reason` says why) so `infermesh status` can show it. `stop()` stops them all
(SIGTERM, then SIGKILL after a grace period) and is safe twice.

Thread safety: one lock guards the list; `watch` runs on the supervisor's main thread, `run`, `alive`
and `retire` on the gRPC threads that scale.
"""

from __future__ import annotations

import enum
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mesh.restarts import RestartPolicy, decide

LOG_TAIL_LINES = 15


class ProcessState(enum.Enum):
    RUNNING = "running"
    RESTARTING = "restarting"  # exited abnormally, waiting out its back-off
    DOWN = "down"  # restarted too often: left down


@dataclass(eq=False)
class Child:
    name: str  # decode-0, router, registry, kv-pool-master...
    kind: str  # its role's name (mesh.registry.Role), or registry / kv-pool
    argv: list[str]
    environment: dict[str, str]
    log: Path
    process: subprocess.Popen | None = None
    state: ProcessState = ProcessState.RUNNING
    restarted_at: list[float] = field(default_factory=list)  # monotonic seconds of each restart
    last_exit: int | None = None  # of its last abnormal exit
    reason: str = ""
    restart_at: float = 0.0  # RESTARTING: when

    def tail(self) -> str:
        """The last lines of its log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


class Children:
    def __init__(self, policy: RestartPolicy, on_restart: Callable[[Child], None] = lambda child: None) -> None:
        self.policy = policy
        self._on_restart = on_restart
        self._lock = threading.Lock()
        self._children: list[Child] = []
        self._stopped = False

    def run(self, name: str, kind: str, argv: list[str], environment: dict[str, str], log: Path) -> Child:
        child = Child(name, kind, argv, environment, log)
        log.write_bytes(b"")
        self._start(child)
        with self._lock:
            self._children.append(child)
        return child

    @staticmethod
    def _start(child: Child) -> None:
        with open(child.log, "ab") as out:  # no preexec_fn: vfork/exec without fork handlers in this gRPC process
            child.process = subprocess.Popen(child.argv, stdout=out, stderr=subprocess.STDOUT, env=child.environment)

    def all(self) -> list[Child]:
        with self._lock:
            return list(self._children)

    def alive(self, kind: str) -> list[Child]:
        """The children of `kind` that serve or will again (running or waiting to restart), oldest first."""
        with self._lock:
            return [c for c in self._children if c.kind == kind and c.state is not ProcessState.DOWN]

    def retire(self, child: Child) -> bool:
        """Let go of `child` if it is waiting out its back-off (scaled down before its restart); False if it is
        running (drain it instead) or down."""
        with self._lock:
            if child.state is not ProcessState.RESTARTING:
                return False
            self._children.remove(child)
            return True

    def exited(self) -> Child | None:
        """The first child whose process has exited, if any (while the mesh starts, that fails the start)."""
        with self._lock:
            return next((c for c in self._children if c.process.poll() is not None), None)

    def watch(self) -> list[str]:
        """One round: let go of clean exits, schedule or refuse restarts of crashes, start the children whose
        back-off has passed. One line per event."""
        events, now = [], time.monotonic()
        with self._lock:
            for child in [] if self._stopped else list(self._children):
                if child.state is ProcessState.RESTARTING and now >= child.restart_at:
                    with open(child.log, "ab") as out:
                        out.write(f"--- restarted by infermesh up: {child.reason}\n".encode())
                    self._start(child)
                    child.state = ProcessState.RUNNING
                    child.restarted_at.append(now)
                    self._on_restart(child)
                    events.append(f"{child.name} restarted (pid {child.process.pid})")
                if child.state is not ProcessState.RUNNING or (code := child.process.poll()) is None:
                    continue
                if code == 0:
                    self._children.remove(child)
                    events.append(f"{child.name} drained and left")
                    continue
                restart = decide(self.policy, code, tuple(child.restarted_at), now)
                child.last_exit, child.reason = code, restart.reason
                if restart.delay_s is None:
                    child.state = ProcessState.DOWN
                else:
                    child.state, child.restart_at = ProcessState.RESTARTING, now + restart.delay_s
                events.append(f"{child.name} {restart.reason} (log: {child.log})")
        return events

    def stop(self, grace_s: float) -> None:
        """SIGTERM every running child, SIGKILL those still running after `grace_s`; none is restarted after."""
        with self._lock:
            self._stopped = True
            children = list(self._children)
            for child in children:
                if child.state is ProcessState.RESTARTING:
                    child.state = ProcessState.DOWN
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
