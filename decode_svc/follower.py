"""What ranks 1..N-1 of a tensor-parallel decode instance add to following the step plans: a KVTransfer
gRPC server of their own, so prefill instances push each rank its heads directly.

Rank 0 publishes each reservation's block table in the instance's store (`reservation/<id>`) before it
answers Reserve; a follower reads it on the first piece and keeps it until a step plan says the
reservation ended — under the receiver's lock, before that step runs, so no piece lands in blocks the
step may reuse. The follower's address is published as `kv-address/<rank>`; for the torch_p2p transport
the follower also joins every pair claimed on the instance's pairing store.
"""

from __future__ import annotations

import threading

from kvtransfer.grpc_stream import KVTransferService
from kvtransfer.pairing import PairListener
from kvtransfer.transport import KVReceiver
from mesh import rpc
from protos.infermesh.v1 import internal_pb2_grpc


def reservation_key(request_id: str) -> str:
    return f"reservation/{request_id}"


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


def accept_kv(rank: int, store, runner, pair_address: str = "", ranks: int = 1):
    """`attach` hook for EngineCore: serve KVTransfer for this rank's cache (and, with `pair_address` and the
    instance's `ranks` bound, join its torch_p2p pairs); returns the before-step hook."""
    view = ReservationView(store)
    receiver = KVReceiver(runner.kv_cache, view.get, view.lock)
    if pair_address:
        PairListener(pair_address, rank, ranks, receiver)
    server, port, _ = rpc.start_server("127.0.0.1", 0, [
        (internal_pb2_grpc.add_KVTransferServicer_to_server, KVTransferService(receiver, rank), "infermesh.v1.KVTransfer")])
    store.set(f"kv-address/{rank}", f"127.0.0.1:{port}")
    accept_kv.server = server  # keep it alive for the process's life
    return view.before_step
