"""gRPC plumbing every service shares: a server with the standard health service, reflection and the
typed-error edge; pooled client channels.

`start_server(host, port, services)` adds each (add_to_server function, servicer,
full service name), registers `grpc.health.v1.Health` and server reflection for
all of them, maps typed failures to status codes (`mesh.errors`), binds and
starts; it returns the server, the bound port and its `Health`, which reports
every service SERVING or NOT_SERVING at once (an instance's lifecycle drives it).
With `loop` (a `mesh.loop.LoopThread`) the server is grpc.aio's, on that loop: its coroutine handlers run
there, plain ones on its threads; `aio_channel` and `ChannelPool(aio_channel)` are the clients to match.
Servers and channels speak TLS when the environment gives the process an identity (`mesh.tls`).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mesh import tls
from mesh.errors import AsyncStatusInterceptor, StatusInterceptor
from mesh.loop import LoopThread
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20
MAX_CONCURRENT_RPCS = 512  # a server's default; an instance's comes from its settings


LIVENESS = "liveness"  # a health "service" that says whether the process should be restarted, not whether it serves


class Health(health.HealthServicer):
    """The standard health service of one server; `set_serving` sets every service and "" at once.
    `LIVENESS` is apart: SERVING while the process works (draining included), NOT_SERVING once it cannot
    (`set_alive(False)`: its engine failed), for liveness probes that must not restart a draining instance."""

    def __init__(self, names: Sequence[str], serving: bool) -> None:
        super().__init__()
        self.names = ("", *names)
        self.set_serving(serving)
        self.set_alive(True)

    def set_alive(self, alive: bool) -> None:
        self.set(LIVENESS, _status(alive))

    def set_serving(self, serving: bool) -> None:
        for name in self.names:
            self.set(name, _status(serving))


def _status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


def start_server(host: str, port: int, services: Sequence[tuple[Callable, object, str]], *, serving: bool = True,
                 max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS, max_request_bytes: int = MAX_MESSAGE_BYTES,
                 client_certs: bool = True, thread_init: Callable[[], None] | None = None,
                 loop: LoopThread | None = None) -> tuple[grpc.Server | AsyncServer, int, Health]:
    """`serving`: what health reports at first (an instance starts NOT_SERVING and says when it serves).
    Each RPC runs on a thread of its own (started when needed), a stream for its whole life: at most
    `max_concurrent_rpcs` at once, the next is refused with RESOURCE_EXHAUSTED rather than queued.
    A request over `max_request_bytes` is refused with RESOURCE_EXHAUSTED (gRPC's message names both sizes).
    With TLS on (`mesh.tls`) the port speaks TLS and, with `client_certs`, takes only the mesh's certificates.
    `thread_init` runs first on each of the server's threads (`engine.threads.off_the_engine_thread`).
    With `loop`: a grpc.aio server on it, its coroutine RPCs on the loop (no thread each), plain ones on threads."""
    pool = futures.ThreadPoolExecutor(max_workers=max_concurrent_rpcs, initializer=thread_init)
    options = [("grpc.max_receive_message_length", max_request_bytes),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    if loop is None:
        server = grpc.server(pool, interceptors=[StatusInterceptor()], maximum_concurrent_rpcs=max_concurrent_rpcs,
                             options=options)
    else:
        async def build() -> grpc.aio.Server:  # an aio server belongs to the loop it is made on
            return grpc.aio.server(migration_thread_pool=pool, interceptors=[AsyncStatusInterceptor()],
                                   maximum_concurrent_rpcs=max_concurrent_rpcs, options=options)
        server = loop.run(build())
    names = []
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    health_servicer = Health(names, serving)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    me = tls.identity()
    address = f"{host}:{port}"
    if me is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.server_credentials(me, client_certs))
    if bound == 0:
        raise OSError(f"cannot bind a gRPC server to {host}:{port}")
    if loop is None:
        server.start()
        return server, bound, health_servicer
    loop.run(server.start())
    return AsyncServer(server, loop), bound, health_servicer


class AsyncServer:
    """A grpc.aio server on a `LoopThread`, stopped from any thread as a `grpc.Server` is: `stop(grace).wait()`."""

    def __init__(self, server: grpc.aio.Server, loop: LoopThread) -> None:
        self.server, self.loop = server, loop

    def stop(self, grace: float | None) -> threading.Event:
        stopped = threading.Event()
        self.loop.submit(self.server.stop(grace)).add_done_callback(lambda _: stopped.set())
        return stopped


def start_health_server(host: str, port: int, health_servicer: Health) -> tuple[grpc.Server, int]:
    """A plaintext server with `health_servicer` alone (what the main server's health says, nothing else),
    for probes that cannot speak TLS; it serves no other service, so TLS guards everything else."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the health server to {host}:{port}")
    server.start()
    return server, bound


_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def channel(address: str) -> grpc.Channel:
    """A channel to a peer: TLS with this process's identity when `mesh.tls` says so, else plaintext."""
    return _dial(grpc, address)


def aio_channel(address: str) -> grpc.aio.Channel:
    """`channel`'s grpc.aio twin, for coroutines (made on the loop it is used on)."""
    return _dial(grpc.aio, address)


def _dial(api, address: str):
    """A channel of `api` (grpc, or grpc.aio: the same two constructors) to `address`."""
    me = tls.identity()
    if me is None:
        return api.insecure_channel(address, options=_CHANNEL_OPTIONS)
    return api.secure_channel(address, *tls.channel_credentials(me, _CHANNEL_OPTIONS))


class ChannelPool:
    """One channel per address, reused across requests and threads; `close()` closes them all.
    `ChannelPool(aio_channel)` pools grpc.aio channels, for one event loop: close those with `aclose()`."""

    def __init__(self, connect: Callable[[str], grpc.Channel | grpc.aio.Channel] = channel) -> None:
        self._connect = connect
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = self._connect(address)
            return self._channels[address]

    def _take_all(self) -> list:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        return channels

    def close(self) -> None:
        for ch in self._take_all():
            ch.close()

    async def aclose(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._take_all()))


class Links:
    """What a service lends the KV transports it hosts (`kvtransfer.transports`): pooled channels to peers,
    gRPC servers of its own on `host` (`close()` closes and stops them all), and `options`, what the service's
    settings tell the transports (a `kvtransfer.transports.KVOptions`)."""

    def __init__(self, host: str, thread_init: Callable[[], None] | None = None, options: object = None) -> None:
        self.host, self.thread_init = host, thread_init  # run first on each thread of the servers it starts
        self.options = options
        self._channels = ChannelPool()
        self._servers: list[grpc.Server] = []

    def channel(self, address: str) -> grpc.Channel:
        return self._channels.get(address)

    def serve(self, services: Sequence[tuple[Callable, object, str]]) -> str:
        """Start a server with `services` on any free port of `host`; its address."""
        server, port, _ = start_server(self.host, 0, services, thread_init=self.thread_init)
        self._servers.append(server)
        return f"{self.host}:{port}"

    def close(self) -> None:
        self._channels.close()
        for server in self._servers:
            server.stop(grace=None)
        self._servers.clear()


def attach_to_experts(address: str, instance_id: str, ranks: int, model: str, timeout_s: float = 30.0) -> dict:
    """Ask the expert instance at `address` for an attachment group for this instance's `ranks`:
    the fields of an `engine.parallel.context.ExpertAttachment` (address, group, expert_ranks)."""
    with channel(address) as ch:
        r = internal_pb2_grpc.ExpertStub(ch).Attach(
            internal_pb2.AttachRequest(instance_id=instance_id, ranks=ranks, model=model), timeout=timeout_s)
    return {"address": r.rendezvous, "group": r.group, "expert_ranks": r.expert_ranks}
