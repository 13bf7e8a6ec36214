"""Every KV transport, by name (settings, CLI) and wire enum (`KVTarget.transport`): one entry each.

Plain Python (no torch): the router validates names and picks wire values here. An entry names the
module that implements the transport; `Transport.load()` imports it and returns its `Parts`, the three
things every transport module defines (their contracts are the Protocols of `kvtransfer.transport`):

    Dialer(rank, ranks, links) -> Dialer        a prefill rank's way to push
    shared(host) -> Shared | None               what the ranks of a decode instance share (rank 0 hosts it)
    Endpoint(rank, ranks, receiver, links, shared_address) -> Endpoint
                                                a decode rank's way to receive

`links` is what the hosting service lends (`kvtransfer.transport.Links`). Adding a transport is one
module and one entry in `TRANSPORTS`.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from engine.errors import Unsupported
from protos.infermesh.v1 import internal_pb2

if TYPE_CHECKING:
    from kvtransfer.transport import Dialer, Endpoint, Shared


@dataclass(frozen=True, slots=True)
class KVOptions:
    """What a service's settings (`mesh.settings.EngineSettings`, where they are declared and checked) tell
    the transports it hosts, through `Links.options`."""

    mooncake_protocol: str
    mooncake_devices: str

    @classmethod
    def of(cls, settings) -> "KVOptions":
        return cls(settings.mooncake_protocol, settings.mooncake_devices)


@dataclass(frozen=True, slots=True)
class Parts:
    dialer: Callable[..., Dialer]
    shared: Callable[[str], Shared | None]
    endpoint: Callable[..., Endpoint]


@dataclass(frozen=True, slots=True)
class Transport:
    name: str
    wire: int  # internal_pb2.KVTransport
    module: str
    cpu_only: bool = False  # its receiver needs gloo (CPU caches)
    requires: str = ""  # a module of an optional dependency it needs (an extra of the package)

    def load(self) -> Parts:
        module = importlib.import_module(self.module)
        missing = [name for name in ("Dialer", "shared", "Endpoint") if not hasattr(module, name)]
        if missing:
            raise TypeError(f"transport {self.name}: {self.module} does not define {', '.join(missing)}")
        return Parts(dialer=module.Dialer, shared=module.shared, endpoint=module.Endpoint)

    def usable(self, device: str) -> bool:
        return not self.needs(device)

    def needs(self, device: str) -> str:
        """What this transport lacks on a `device` cache here ("": nothing)."""
        if self.cpu_only and device != "cpu":
            return "CPU KV caches"
        if self.requires and not importable(self.requires):
            return f"{self.requires.split('.')[0]} installed (pip install 'infermesh[{self.name}]')"
        return ""


TRANSPORTS = (
    Transport("grpc_stream", internal_pb2.KV_TRANSPORT_GRPC_STREAM, "kvtransfer.grpc_stream"),
    Transport("torch_p2p", internal_pb2.KV_TRANSPORT_TORCH_P2P, "kvtransfer.pairing", cpu_only=True),
    Transport("shared_memory", internal_pb2.KV_TRANSPORT_SHARED_MEMORY, "kvtransfer.shared_memory"),  # one host
    Transport("mooncake", internal_pb2.KV_TRANSPORT_MOONCAKE, "kvtransfer.mooncake", requires="mooncake.engine"),
)
NAMES = tuple(t.name for t in TRANSPORTS)


@functools.cache
def importable(module: str) -> bool:
    """Whether `module` imports here (an optional dependency installed, with the libraries it loads)."""
    try:
        importlib.import_module(module)
    except (ImportError, OSError):
        return False
    return True


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
