"""Every KV transport, by name (settings, CLI) and wire enum (`KVTarget.transport`): one entry each.

Plain Python (no torch): the router validates names and picks wire values here. An entry names the
module that implements the transport; `Transport.load()` imports it. That module provides

    Dialer(rank, ranks, links)
        a prefill rank's way to push (reused across requests): `prepare(addresses)` on rank 0 before a
        push is published (a link number every rank then passes back), `senders(addresses, link,
        request_id, timeout_s)` one `KVSender` per decode rank, `close()`;
    shared(host) -> an object with `.address` and `close()`, or None
        what every rank of a decode instance shares, hosted by rank 0 before its ranks start (a store);
    Endpoint(rank, ranks, receiver, links, shared_address)
        a decode rank's way to receive into its `KVReceiver`: `.address` (what the KV target lists for
        this rank) and `stop()`.

`links` is what the hosting service lends: `host`, `channel(address)` and `serve(services) -> address`
(gRPC channels and servers with the service's settings). Adding a transport is one module and one
entry in `TRANSPORTS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from engine.errors import Unsupported
from protos.infermesh.v1 import internal_pb2


@dataclass(frozen=True, slots=True)
class Transport:
    name: str
    wire: int  # internal_pb2.KVTransport
    module: str
    cpu_only: bool = False  # its receiver needs gloo (CPU caches)

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def usable(self, device: str) -> bool:
        return device == "cpu" or not self.cpu_only


TRANSPORTS = (
    Transport("grpc_stream", internal_pb2.KV_TRANSPORT_GRPC_STREAM, "kvtransfer.grpc_stream"),
    Transport("torch_p2p", internal_pb2.KV_TRANSPORT_TORCH_P2P, "kvtransfer.pairing", cpu_only=True),
    Transport("shared_memory", internal_pb2.KV_TRANSPORT_SHARED_MEMORY, "kvtransfer.shared_memory"),  # one host
)
NAMES = tuple(t.name for t in TRANSPORTS)


def by_name(name: str) -> Transport:
    for t in TRANSPORTS:
        if t.name == name:
            return t
    raise ValueError(f"kv_transport must be one of {', '.join(NAMES)}, got {name!r}")


def by_wire(wire: int) -> Transport:
    """The transport a KV target names; `Unsupported` for one no entry implements."""
    for t in TRANSPORTS:
        if t.wire == wire:
            return t
    raise Unsupported(f"transport must be one of {', '.join(_wire_name(t.wire) for t in TRANSPORTS)}, "
                      f"got {_wire_name(wire)}")


def _wire_name(wire: int) -> str:
    try:
        return internal_pb2.KVTransport.Name(wire)
    except ValueError:  # a value the proto does not define
        return str(wire)
