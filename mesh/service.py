"""The process around an instance: its registry heartbeat, and `serve`, the `main` of every service
(settings from flags and INFERMESH_* variables, tracing, dying with the `infermesh up` supervisor,
serving until SIGINT/SIGTERM or until the instance stops itself, e.g. after a drain)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

from engine.parallel.lifetime import die_with_parent
from mesh.registry import InstanceInfo, Registry


class Heartbeat:
    """Registers `record()` every `interval_s` with a TTL, and the KV block hashes `block_hashes()` says the
    instance holds (for prefix-aware routing); `beat_now()` registers at once (a state changed);
    `stop()` deregisters (safe twice)."""

    def __init__(self, registry: Registry, record: Callable[[], InstanceInfo], interval_s: float, ttl_s: float,
                 block_hashes: Callable[[], set[int]] | None = None) -> None:
        self.registry, self.record, self.interval_s, self.ttl_s = registry, record, interval_s, ttl_s
        self.block_hashes = block_hashes
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.instance_id = record().id
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def beat_now(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.registry.register(self.record(), self.ttl_s)
                if self.block_hashes is not None:
                    self.registry.set_block_hashes(self.instance_id, self.block_hashes(), self.ttl_s)
            except Exception:  # the registry is unreachable: try again next beat; the TTL decides liveness
                pass
            self._wake.wait(self.interval_s)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        try:
            self.registry.deregister(self.instance_id)
        except Exception:  # the registry is gone too: the record expires by its TTL
            pass
        finally:
            self.registry.close()


def serve(role: str, settings_class, start, argv: list[str] | None = None, *,
          pin: Callable[[str, str], None] | None = None) -> None:
    """The `main` of a service: `start(settings)` returns a serving `mesh.instance.Instance`. An engine
    service passes `pin` (`engine.threads.pin_cpus`): its `cpus` and `borrow_cpus` settings applied first."""
    from mesh.settings import load, parse_flags
    from mesh.telemetry import setup_tracing

    if "INFERMESH_PARENT_PID" in os.environ:  # started by `infermesh up`: die with it, even if it is killed
        die_with_parent(int(os.environ["INFERMESH_PARENT_PID"]))
    settings = load(settings_class, parse_flags(settings_class, argv))
    if pin is not None:
        pin(settings.cpus, getattr(settings, "borrow_cpus", ""))
    setup_tracing(settings.trace, role)
    instance = start(settings)
    http = instance.record().http_address
    print(f"{role} {instance.id} serving on {instance.address}" + (f" (http {http})" if http else ""), flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    threading.Thread(target=lambda: (instance.wait(), done.set()), name="instance-watch", daemon=True).start()
    stopper = threading.Thread(target=lambda: (done.wait(), instance.stop()), name="stopper")
    stopper.start()
    instance.run(done)  # the main thread drives the engine, where there is one
    stopper.join()
