"""gRPC plumbing every service shares: a server with the standard health service and reflection.

`start_server(host, port, services)` adds each (add_to_server function, servicer,
full service name), registers `grpc.health.v1.Health` (every service SERVING)
and server reflection for all of them, binds and starts; it returns the server,
the bound port and the health servicer (to report NOT_SERVING while draining).
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20


def start_server(host: str, port: int, services: Sequence[tuple[Callable, object, str]], *,
                 max_workers: int = 16) -> tuple[grpc.Server, int, health.HealthServicer]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = []
    for add, servicer, name in services:
        add(servicer, server)
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        names.append(name)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind a gRPC server to {host}:{port}")
    server.start()
    return server, bound, health_servicer


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])


class ChannelPool:
    """One channel per address, reused across requests and threads; `close()` closes them all."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = channel(address)
            return self._channels[address]

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


def attach_to_experts(address: str, instance_id: str, ranks: int, model: str, timeout_s: float = 30.0) -> dict:
    """Ask the expert instance at `address` for an attachment group for this instance's `ranks`:
    the fields of an `engine.parallel.context.ExpertAttachment` (address, group, expert_ranks)."""
    with channel(address) as ch:
        r = internal_pb2_grpc.ExpertStub(ch).Attach(
            internal_pb2.AttachRequest(instance_id=instance_id, ranks=ranks, model=model), timeout=timeout_s)
    return {"address": r.rendezvous, "group": r.group, "expert_ranks": r.expert_ranks}
