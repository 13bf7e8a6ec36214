"""The registry contract: instances announce themselves with a time to live and disappear when they stop.

An instance calls `register` at start and again as its heartbeat (each call
replaces its record and renews the TTL); a record not renewed within its TTL is
gone from `instances()`. Prefill and decode instances also publish the hashes of
the KV blocks they hold (`set_block_hashes`, the same hash chain as the engine's
prefix cache), so the router can ask `prefix_hits(chain)`: how many leading
blocks of a prompt each live instance already holds, or read a `snapshot()` of it all.
"""

from __future__ import annotations

import abc
import enum
import json
from dataclasses import asdict, dataclass, field


class Role(str, enum.Enum):
    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"
    EXPERT = "expert"
    SUPERVISOR = "supervisor"  # the `infermesh up` process of a single-host mesh


class InstanceState(str, enum.Enum):
    """An instance's lifecycle (`mesh.instance`): STARTING -> SERVING -> DRAINING -> STOPPED."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"  # finishing what it holds, taking nothing new (also after an engine failure)
    STOPPED = "stopped"


@dataclass(frozen=True, kw_only=True, slots=True)
class InstanceInfo:
    id: str
    role: Role
    address: str  # host:port of its gRPC server
    pid: int
    model: str
    parallel: dict[str, int] = field(default_factory=lambda: {"tp": 1, "cp": 1, "ep": 1})
    state: InstanceState = InstanceState.STARTING
    active_requests: int = 0
    total_requests: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    block_size: int = 0  # prefill and decode instances: tokens per KV block
    http_address: str = ""  # a router's OpenAI-compatible HTTP front, when it serves one
    metrics_url: str = ""  # where Prometheus scrapes the instance
    rendezvous: str = ""  # host:port of a TCPStore for process groups with this instance (expert attachment)
    placement: tuple[int, ...] = ()  # expert instances: the owner EP rank of each expert

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "InstanceInfo":
        data = json.loads(text)
        return cls(**data | {"role": Role(data["role"]), "state": InstanceState(data["state"]),
                             "placement": tuple(data.get("placement", ()))})


class Registry(abc.ABC):
    @abc.abstractmethod
    def register(self, info: InstanceInfo, ttl_s: float) -> None:
        """Create or replace the record of `info.id`, live for `ttl_s` seconds from now."""

    @abc.abstractmethod
    def deregister(self, instance_id: str) -> None:
        """Remove the record and its block hashes now (a no-op when absent)."""

    @abc.abstractmethod
    def instances(self, role: Role | None = None) -> list[InstanceInfo]:
        """Live records, of one role or all, ordered by id."""

    @abc.abstractmethod
    def set_block_hashes(self, instance_id: str, hashes: set[int], ttl_s: float) -> None:
        """Replace the set of KV block hashes `instance_id` holds."""

    @abc.abstractmethod
    def prefix_hits(self, chain: list[int]) -> dict[str, int]:
        """For each live instance: how many leading hashes of `chain` it holds."""

    @abc.abstractmethod
    def snapshot(self) -> tuple[list[InstanceInfo], dict[str, frozenset[int]]]:
        """Every live record (ordered by id) and the block hashes each holds, read together: what a router
        keeps in memory to route without a read per request (`mesh.registry.snapshot`)."""

    def instances_and_hits(self, chain: list[int]) -> tuple[list[InstanceInfo], dict[str, int]]:
        """`instances()` and `prefix_hits(chain)` (none read for an empty chain): what a router reads per request
        (from its `mesh.registry.snapshot.Snapshot`, which answers both from one snapshot)."""
        return self.instances(), self.prefix_hits(chain) if chain else {}

    def close(self) -> None:  # noqa: B027 - a registry without connections has nothing to release
        """Release connections; safe to call twice."""
