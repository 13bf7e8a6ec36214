"""A registry read through its last answers: the router keeps routing while the registry is unreachable.

`LastKnown(registry)` answers `instances` and `prefix_hits` from the registry while it answers and, when a
read fails (Redis restarting, a partition), from the last answer it had to the same question, for as long
as the outage lasts (prefix hits: none). After a failure it waits `retry_s` before asking the registry
again, so that an unreachable host costs one connect timeout, not one per request. With no answer yet
to fall back on, a read raises `Unavailable`. Writes pass through: the heartbeat retries them itself,
and instances re-register once the registry is back.
"""

from __future__ import annotations

import logging
import threading
import time

from engine.errors import Unavailable
from mesh.registry.base import InstanceInfo, Registry, Role

log = logging.getLogger(__name__)


class LastKnown(Registry):
    def __init__(self, registry: Registry, retry_s: float = 1.0) -> None:
        self.registry = registry
        self.retry_s = retry_s
        self._answers: dict[Role | None, list[InstanceInfo]] = {}
        self._down_until = 0.0  # monotonic time before which the registry is not asked again
        self._lock = threading.Lock()

    def instances(self, role: Role | None = None) -> list[InstanceInfo]:
        if time.monotonic() >= self._down_until:
            try:
                found = self.registry.instances(role)
            except Exception as e:  # noqa: BLE001 - whatever the client raises, the answer is the last one
                self._failed(e)
            else:
                with self._lock:
                    self._answers[role] = found
                return found
        with self._lock:
            if role not in self._answers:
                raise Unavailable("the registry is unreachable and this router has not read it yet")
            return list(self._answers[role])

    def instances_and_hits(self, chain: list[int]) -> tuple[list[InstanceInfo], dict[str, int]]:
        if time.monotonic() >= self._down_until:
            try:
                found, hits = self.registry.instances_and_hits(chain)
            except Exception as e:  # noqa: BLE001
                self._failed(e)
            else:
                with self._lock:
                    self._answers[None] = found
                return found, hits
        return self.instances(), {}

    def prefix_hits(self, chain: list[int]) -> dict[str, int]:
        if time.monotonic() >= self._down_until:
            try:
                return self.registry.prefix_hits(chain)
            except Exception as e:  # noqa: BLE001
                self._failed(e)
        return {}

    def _failed(self, error: Exception) -> None:
        if time.monotonic() >= self._down_until:
            log.warning("registry unreachable (%s): routing on the last instances read for %.1f s",
                        error, self.retry_s)
        self._down_until = time.monotonic() + self.retry_s

    def register(self, info: InstanceInfo, ttl_s: float) -> None:
        self.registry.register(info, ttl_s)

    def deregister(self, instance_id: str) -> None:
        self.registry.deregister(instance_id)

    def set_block_hashes(self, instance_id: str, hashes: set[int], ttl_s: float) -> None:
        self.registry.set_block_hashes(instance_id, hashes, ttl_s)

    def close(self) -> None:
        self.registry.close()
