"""What ranks 1..N-1 of a tensor-parallel decode instance add to following the step plans: an endpoint of
every KV transport the instance offers, so prefill instances push each rank its heads directly.

Rank 0 publishes each reservation's block table in the instance's store (`kvtransfer.control.RESERVATION`)
before it answers Reserve; a follower reads it on the first piece and keeps it until a step plan says the
reservation ended — under the receiver's lock, before that step runs, so no piece lands in blocks the
step may reuse. Each rank publishes its endpoint of each transport (`KV_ENDPOINT`).
"""

from __future__ import annotations

import logging
import threading

from engine.parallel.control import Store
from engine.threads import off_the_engine_thread
from kvtransfer import transports
from kvtransfer.control import KV_ENDPOINT, RESERVATION, KVEndpoint
from kvtransfer.transport import KVReceiver
from kvtransfer.transports import KVOptions
from mesh import rpc

log = logging.getLogger(__name__)
WRITE_WAIT_S = 60.0  # a write's grant stream ends by its push's deadline (prefill's transfer timeout)


def open_endpoints(rank: int, ranks: int, receiver: KVReceiver, links: rpc.Links,
                   shared: dict[str, str | None]) -> dict:
    """This rank's endpoint of each transport in `shared` (transport name -> the address rank 0 shares)."""
    return {name: transports.by_name(name).load().endpoint(rank, ranks, receiver, links, address)
            for name, address in shared.items()}


class ReservationView:
    def __init__(self, store: Store) -> None:
        self.store, self.lock = store, threading.Lock()
        self._tables: dict[str, tuple[int, ...]] = {}

    def get(self, request_id: str) -> tuple[int, ...] | None:
        """Called under `lock` by the receiver."""
        table = self._tables.get(request_id)
        if table is None and (reservation := self.store.peek(RESERVATION.key(request_id))) is not None:
            table = self._tables[request_id] = reservation.block_table
        return table

    def before_step(self, plan) -> None:
        with self.lock:
            for request_id in plan.ended_reservations:
                self._tables.pop(request_id, None)


class KVFollower:
    """One follower rank's receiving side: its endpoints (alive as long as this object) and its reservations."""

    def __init__(self, rank: int, store: Store, runner, host: str, ranks: int, shared: dict[str, str | None],
                 options: KVOptions) -> None:
        self.view = ReservationView(store)
        self.links = rpc.Links(host, thread_init=off_the_engine_thread, options=options)
        self.receiver = KVReceiver(runner.kv_cache, self.view.get, self.view.lock)
        self.endpoints = open_endpoints(rank, ranks, self.receiver, self.links, shared)
        for name, endpoint in self.endpoints.items():
            store.put(KV_ENDPOINT.key(name, rank), KVEndpoint(endpoint.address))

    def before_step(self, plan) -> None:
        """Forget the ended reservations; a transport still writing into one of them itself (mooncake) is
        waited for, since the step may reuse its blocks."""
        self.view.before_step(plan)
        ended = plan.ended_reservations
        if ended:
            with self.view.lock:
                if not self.receiver.wait_landed(ended, WRITE_WAIT_S):
                    log.error("KV writes into ended reservations %s still open after %s s", list(ended), WRITE_WAIT_S)


def accept_kv(rank: int, store: Store, runner, host: str, *, ranks: int, shared: dict[str, str | None],
              options: KVOptions):
    """The `follower_hook` of EngineCore (`Call.of(accept_kv, ranks=..., shared=..., options=...)`): open this
    rank's KV endpoints on its `host` and publish them; returns the before-step hook (it keeps them for the
    process's life)."""
    return KVFollower(rank, store, runner, host, ranks, shared, options).before_step
