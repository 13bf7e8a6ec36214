"""Routing policies: pure functions over a snapshot of the registry.

`route()` sheds the request (`Overloaded`, with why) when no serving decode
instance has room: free KV blocks for the prompt's uncached part and fewer than
`max_active` requests. Among those with room it picks one by the policy
(round-robin, least-load: fewest active requests then most free KV blocks,
prefix-aware: most leading prompt blocks already cached there, then
least-load), then decides where the
prompt is prefilled — conditional disaggregation: on the decode instance itself
when no prefill instance serves, when the uncached part of the prompt is short
(<= `local_prefill_max_tokens`), or when every prefill instance is saturated;
otherwise on the least-loaded prefill instance. The reason is part of the answer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.errors import Overloaded, Unavailable
from mesh.registry import InstanceInfo, InstanceState

POLICIES = ("round_robin", "least_load", "prefix_aware")


class NoInstance(Unavailable):
    """No instance of a needed role is serving."""


class Decision(str, enum.Enum):
    """Where a prompt is prefilled, and why (a metric label; `Route.reason` says it with the numbers)."""

    DISAGGREGATED = "disaggregated"
    LOCAL_NO_PREFILL = "local_no_prefill"  # no prefill instance serves
    LOCAL_SHORT = "local_short_uncached"  # the uncached part is short
    LOCAL_SATURATED = "local_prefill_saturated"  # every prefill instance is busy


@dataclass(frozen=True, slots=True)
class Route:
    decode: InstanceInfo
    prefill: InstanceInfo | None  # None: the decode instance prefills
    uncached_tokens: int
    decision: Decision
    reason: str


def least_load_key(info: InstanceInfo) -> tuple:
    return info.active_requests, -(info.kv_blocks_total - info.kv_blocks_used), info.id


def pick(policy: str, candidates: list[InstanceInfo], turn: int, prefix_hits: dict[str, int]) -> InstanceInfo:
    if not candidates:
        raise NoInstance("no instance to pick from")
    ordered = sorted(candidates, key=lambda i: i.id)
    if policy == "round_robin":
        return ordered[turn % len(ordered)]
    if policy == "least_load":
        return min(ordered, key=least_load_key)
    if policy == "prefix_aware":
        return min(ordered, key=lambda i: (-prefix_hits.get(i.id, 0), *least_load_key(i)))
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def route(*, prompt_tokens: int, decodes: list[InstanceInfo], prefills: list[InstanceInfo], policy: str, turn: int,
          prefix_hits: dict[str, int], block_size: int, local_prefill_max_tokens: int,
          prefill_saturation: int = 16, max_active: int = 256) -> Route:
    serving = [d for d in decodes if d.state is InstanceState.SERVING]
    if not serving:
        raise NoInstance("no decode instance is serving")
    room, full = [], []
    for d in serving:
        need = -(-max(1, prompt_tokens - prefix_hits.get(d.id, 0) * block_size) // max(block_size, 1))
        free = d.kv_blocks_total - d.kv_blocks_used
        if d.kv_blocks_total and free < need:
            full.append(f"{d.id}: {free} free KV blocks, the prompt needs {need}")
        elif d.active_requests >= max_active:
            full.append(f"{d.id}: {d.active_requests} requests >= {max_active}")
        else:
            room.append(d)
    if not room:
        raise Overloaded("every decode instance is saturated (" + "; ".join(full) + "): try again later")
    decode = pick(policy, room, turn, prefix_hits)
    uncached = max(0, prompt_tokens - prefix_hits.get(decode.id, 0) * block_size)
    available = [p for p in prefills if p.state is InstanceState.SERVING]
    if not available:
        return Route(decode, None, uncached, Decision.LOCAL_NO_PREFILL,
                     "no prefill instance is serving: prefill on decode")
    if uncached <= local_prefill_max_tokens:
        return Route(decode, None, uncached, Decision.LOCAL_SHORT,
                     f"{uncached} uncached tokens <= local_prefill_max_tokens={local_prefill_max_tokens}: "
                     "prefill on decode")
    unsaturated = [p for p in available if p.active_requests < prefill_saturation]
    if not unsaturated:
        return Route(decode, None, uncached, Decision.LOCAL_SATURATED,
                     f"every prefill instance has >= {prefill_saturation} active requests: prefill on decode")
    prefill = min(unsaturated, key=least_load_key)
    return Route(decode, prefill, uncached, Decision.DISAGGREGATED, f"{uncached} uncached tokens: disaggregated")
