"""The router's registry, read from memory: routing a request reads no registry on its path.

`Snapshot(registry)` answers `instances`, `prefix_hits` and `instances_and_hits` from the last
`registry.snapshot()` it read (every live record and the block hashes each holds; prefix hits are counted
here). A read per request was one round trip on every request's path (~1 ms to the supervisor's
registry); now:

- a snapshot younger than `refresh_s` answers as it is;
- an older one answers too, and a read starts in the background (one at a time);
- with none yet, one older than `stale_s`, or one without a serving decode instance (a mesh starting, a
  decode instance back), the request reads the registry itself first.

So an answer lags the registry by about `refresh_s` while requests flow, on top of the registry's own lag
behind the instances (their heartbeat): the router adds what it routed itself (`router.core`), and an
instance that left meanwhile refuses (UNAVAILABLE) and the router tries another.

When a read fails (Redis restarting, a partition) the snapshot stays as it was for as long as the outage
lasts, so the router routes on the last instances it read (with their last block hashes); a request reads
the registry itself again only `retry_s` after a failure, so an unreachable registry costs one connect
timeout per `retry_s`, not one per request. With no snapshot yet, a failed read raises `Unavailable`.
`due()` says whether the next answer reads the registry first (a caller on an event loop does that on a
thread). Writes pass through.
"""

from __future__ import annotations

import logging
import threading
import time

from engine.errors import Unavailable
from mesh.registry.base import InstanceInfo, InstanceState, Registry, Role
from mesh.registry.memory import leading

log = logging.getLogger(__name__)


class Snapshot(Registry):
    def __init__(self, registry: Registry, refresh_s: float = 0.25, stale_s: float = 5.0,
                 retry_s: float = 1.0) -> None:
        self.registry, self.refresh_s, self.stale_s, self.retry_s = registry, refresh_s, stale_s, retry_s
        self._instances: list[InstanceInfo] | None = None  # None: never read
        self._blocks: dict[str, frozenset[int]] = {}
        self._read_at = 0.0  # monotonic time of the last read that succeeded
        self._retry_at = 0.0  # after a failed read: no read on a request's path before this
        self._reading = False  # a background read is running
        self._lock = threading.Lock()

    def due(self) -> bool:
        """Whether `current()` would read the registry first, on the caller's thread (one connect timeout at
        worst): an event loop asks this, to make that read on a thread rather than stall its other work."""
        now = time.monotonic()
        with self._lock:
            instances, age = self._instances, now - self._read_at
        return self._stale(instances, age) and now >= self._retry_at

    def _stale(self, instances: list[InstanceInfo] | None, age: float) -> bool:
        return instances is None or age >= self.stale_s or not any(
            i.role is Role.DECODE and i.state is InstanceState.SERVING for i in instances)

    def current(self) -> tuple[list[InstanceInfo], dict[str, frozenset[int]]]:
        """The instances and their block hashes, read again first or in the background as the rules say."""
        now = time.monotonic()
        with self._lock:
            instances, blocks, age = self._instances, self._blocks, now - self._read_at
        if self._stale(instances, age):
            if now >= self._retry_at:
                self._read()
                with self._lock:
                    instances, blocks = self._instances, self._blocks
        elif age >= self.refresh_s:
            with self._lock:
                start, self._reading = not self._reading, True
            if start:  # this request is answered from the snapshot it found
                threading.Thread(target=self._read, args=(True,), name="registry-snapshot", daemon=True).start()
        if instances is None:
            raise Unavailable("the registry is unreachable and this router has not read it yet")
        return instances, blocks

    def _read(self, background: bool = False) -> None:
        try:
            instances, blocks = self.registry.snapshot()
        except Exception as e:  # noqa: BLE001 - whatever the client raises, the answer is the last snapshot
            if time.monotonic() >= self._retry_at:
                log.warning("registry unreachable (%s): routing on the last instances read", e)
            self._retry_at = time.monotonic() + self.retry_s
        else:
            with self._lock:
                self._instances, self._blocks, self._read_at = instances, blocks, time.monotonic()
        finally:
            if background:
                with self._lock:
                    self._reading = False

    def instances(self, role: Role | None = None) -> list[InstanceInfo]:
        return [i for i in self.current()[0] if role in (None, i.role)]

    def prefix_hits(self, chain: list[int]) -> dict[str, int]:
        try:
            return _hits(*self.current(), chain)
        except Unavailable:
            return {}

    def instances_and_hits(self, chain: list[int]) -> tuple[list[InstanceInfo], dict[str, int]]:
        instances, blocks = self.current()
        return list(instances), _hits(instances, blocks, chain) if chain else {}

    def snapshot(self) -> tuple[list[InstanceInfo], dict[str, frozenset[int]]]:
        return self.current()

    def register(self, info: InstanceInfo, ttl_s: float) -> None:
        self.registry.register(info, ttl_s)

    def deregister(self, instance_id: str) -> None:
        self.registry.deregister(instance_id)

    def set_block_hashes(self, instance_id: str, hashes: set[int], ttl_s: float) -> None:
        self.registry.set_block_hashes(instance_id, hashes, ttl_s)

    def close(self) -> None:
        self.registry.close()


def _hits(instances: list[InstanceInfo], blocks: dict[str, frozenset[int]], chain: list[int]) -> dict[str, int]:
    return {i.id: leading(chain, blocks.get(i.id, frozenset())) for i in instances}
