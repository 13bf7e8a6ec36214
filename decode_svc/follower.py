"""What ranks 1..N-1 of a tensor-parallel decode instance add to following the step plans: an endpoint of
every KV transport the instance offers, so prefill instances push each rank its heads directly.

Rank 0 publishes each reservation's block table in the instance's store (`reservation/<id>`) before it
answers Reserve; a follower reads it on the first piece and keeps it until a step plan says the
reservation ended — under the receiver's lock, before that step runs, so no piece lands in blocks the
step may reuse. Each rank publishes its endpoint of each transport as `kv-endpoint/<transport>/<rank>`.
"""

from __future__ import annotations

import threading

from engine.threads import off_the_engine_thread
from kvtransfer import transports
from kvtransfer.transport import KVReceiver
from mesh import rpc


def reservation_key(request_id: str) -> str:
    return f"reservation/{request_id}"


def endpoint_key(transport: str, rank: int) -> str:
    return f"kv-endpoint/{transport}/{rank}"


def open_endpoints(rank: int, ranks: int, receiver: KVReceiver, links: rpc.Links,
                   shared: dict[str, str | None]) -> dict:
    """This rank's endpoint of each transport in `shared` (transport name -> the address rank 0 shares)."""
    return {name: transports.by_name(name).load().Endpoint(rank, ranks, receiver, links, address)
            for name, address in shared.items()}


class ReservationView:
    def __init__(self, store) -> None:
        self.store, self.lock = store, threading.Lock()
        self._tables: dict[str, tuple[int, ...]] = {}

    def get(self, request_id: str) -> tuple[int, ...] | None:
        """Called under `lock` by the receiver."""
        table = self._tables.get(request_id)
        if table is None and self.store.check([reservation_key(request_id)]):
            table = tuple(int(b) for b in self.store.get(reservation_key(request_id)).decode().split(","))
            self._tables[request_id] = table
        return table

    def before_step(self, plan) -> None:
        with self.lock:
            for request_id in plan.ended_reservations:
                self._tables.pop(request_id, None)


class KVFollower:
    """One follower rank's receiving side: its endpoints (alive as long as this object) and its reservations."""

    def __init__(self, rank: int, store, runner, host: str, ranks: int, shared: dict[str, str | None]) -> None:
        self.view = ReservationView(store)
        self.links = rpc.Links(host, thread_init=off_the_engine_thread)
        receiver = KVReceiver(runner.kv_cache, self.view.get, self.view.lock)
        self.endpoints = open_endpoints(rank, ranks, receiver, self.links, shared)
        for name, endpoint in self.endpoints.items():
            store.set(endpoint_key(name, rank), endpoint.address)

    def before_step(self, plan) -> None:
        self.view.before_step(plan)


def accept_kv(rank: int, store, runner, host: str, *, ranks: int, shared: dict[str, str | None]):
    """The `follower_hook` of EngineCore (bind the keywords with functools.partial): open this rank's KV
    endpoints on its `host` and publish them; returns the before-step hook (it keeps them for the process's
    life)."""
    return KVFollower(rank, store, runner, host, ranks, shared).before_step
