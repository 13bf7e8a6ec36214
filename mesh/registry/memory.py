"""The in-memory registry: the embedded default of a single-host mesh (thread-safe; one process)."""

from __future__ import annotations

import threading
import time

from mesh.registry.base import InstanceInfo, Registry, Role


class MemoryRegistry(Registry):
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, tuple[InstanceInfo, float]] = {}  # id -> (info, expires at)
        self._blocks: dict[str, set[int]] = {}

    def register(self, info: InstanceInfo, ttl_s: float) -> None:
        with self._lock:
            self._records[info.id] = (info, self._clock() + ttl_s)

    def deregister(self, instance_id: str) -> None:
        with self._lock:
            self._records.pop(instance_id, None)
            self._blocks.pop(instance_id, None)

    def instances(self, role: Role | None = None) -> list[InstanceInfo]:
        with self._lock:
            self._expire()
            return sorted((info for info, _ in self._records.values() if role in (None, info.role)), key=lambda i: i.id)

    def set_block_hashes(self, instance_id: str, hashes: set[int], ttl_s: float) -> None:
        with self._lock:
            self._blocks[instance_id] = set(hashes)

    def prefix_hits(self, chain: list[int]) -> dict[str, int]:
        with self._lock:
            self._expire()
            return {iid: leading(chain, self._blocks.get(iid, set())) for iid in sorted(self._records)}

    def snapshot(self) -> tuple[list[InstanceInfo], dict[str, frozenset[int]]]:
        with self._lock:
            self._expire()
            ids = sorted(self._records)
            return [self._records[i][0] for i in ids], {i: frozenset(self._blocks.get(i, ())) for i in ids}

    def _expire(self) -> None:
        now = self._clock()
        for iid in [iid for iid, (_, expires) in self._records.items() if expires <= now]:
            del self._records[iid]
            self._blocks.pop(iid, None)


def leading(chain: list[int], held: set[int] | frozenset[int]) -> int:
    """How many leading hashes of `chain` are in `held`."""
    count = 0
    for h in chain:
        if h not in held:
            break
        count += 1
    return count
