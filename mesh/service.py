"""The runtime shell every service shares: a registry heartbeat, dying with the supervisor, and `serve`
(settings from flags and INFERMESH_* variables, tracing, run until SIGINT/SIGTERM, stop)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Callable

from mesh.registry import InstanceInfo, Registry


class Heartbeat:
    """Registers `record()` every `interval_s` with a TTL, and the KV block hashes `block_hashes()` says the
    instance holds (for prefix-aware routing); `stop()` deregisters (safe twice)."""

    def __init__(self, registry: Registry, record: Callable[[], InstanceInfo], interval_s: float, ttl_s: float,
                 block_hashes: Callable[[], set[int]] | None = None) -> None:
        self.registry, self.record, self.interval_s, self.ttl_s = registry, record, interval_s, ttl_s
        self.block_hashes = block_hashes
        self._stop = threading.Event()
        self.instance_id = record().id
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.registry.register(self.record(), self.ttl_s)
                if self.block_hashes is not None:
                    self.registry.set_block_hashes(self.instance_id, self.block_hashes(), self.ttl_s)
            except Exception:  # the registry is unreachable: try again next beat; the TTL decides liveness
                pass
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.registry.deregister(self.instance_id)
        except Exception:  # the registry is gone too: the record expires by its TTL
            pass
        finally:
            self.registry.close()


def die_with_supervisor() -> None:
    """When started by `infermesh up` (INFERMESH_PARENT_PID set): die with the supervisor, even if it is killed."""
    parent = os.environ.get("INFERMESH_PARENT_PID")
    if parent is None:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != int(parent):  # it died before prctl took effect
        os._exit(1)


def run_until_signalled(stop: Callable[[], None]) -> None:
    """Block until SIGINT or SIGTERM, then call `stop`."""
    signalled = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: signalled.set())
    signalled.wait()
    stop()


def serve(role: str, settings_class, start, argv: list[str] | None = None) -> None:
    """The `main` of a service: `start(settings)` returns an instance with `id`, `address` and `stop()`."""
    from mesh.settings import load, parse_flags
    from mesh.telemetry import setup_tracing

    die_with_supervisor()
    settings = load(settings_class, parse_flags(settings_class, argv))
    setup_tracing(settings.trace, role)
    instance = start(settings)
    print(f"{role} {instance.id} serving on {instance.address}", flush=True)
    run_until_signalled(instance.stop)
