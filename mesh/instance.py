"""The lifecycle every service instance shares (router, prefill, decode, expert) and its Admin service.

    STARTING --serve()--> SERVING --drain()--> DRAINING --in-flight work done, or timeout--> STOPPED
                             \\--fail()--> DRAINING (the engine failed: it serves nothing more)
    stop(), from any state --> STOPPED

- gRPC health (`grpc.health.v1`: every service of the server, and "") says SERVING only in SERVING:
  NOT_SERVING while STARTING and DRAINING; once STOPPED the server is gone. Its `liveness` entry stays
  SERVING while draining and turns NOT_SERVING when the engine fails (what a liveness probe asks).
  With `health_port` set the same health is served there too, in plaintext and alone (TLS probes).
- The registry record carries the state: the heartbeat renews it and every transition publishes it at
  once, so routers stop sending work to an instance as soon as it drains or fails.
- New work passes `admit()`, which raises `Draining` (UNAVAILABLE at the gRPC edge) unless SERVING.
  Work already admitted — a running stream, a KV reservation waiting for its join — goes on.
- `drain(timeout_s)`: DRAINING, wait until `in_flight()` is 0 or the timeout passed, then `stop()`.
  `Admin.Drain` begins it and answers at once; the rest runs on a thread of its own.
- `stop()`: deregister, stop the gRPC server, then `close()` what the service owns. Safe twice and
  from any thread; `wait()` returns once it is done (a service's main exits then).

A service subclasses `Instance`: it sets `role`, builds its parts, calls `serve(services)` last, and
overrides `in_flight()`, `describe()` (the fields of its record: load, layout, KV blocks), `close()`
and, when its Admin status says more than its record, `status()`.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Callable, Sequence

from engine.errors import Draining
from mesh import auth, rpc
from mesh.loop import LoopThread
from mesh.metrics import Metrics
from mesh.registry import InstanceInfo, InstanceState, Registry, Role, connect_registry
from mesh.registry.remote import to_message
from mesh.service import Heartbeat
from mesh.settings import ServiceSettings
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc

DRAIN_POLL_S = 0.05
# on stop, calls in flight get this long to finish (a Drain's own reply races the stop it starts on an idle
# instance); streams still running after a drain's timeout are cancelled then
STOP_GRACE_S = 1.0


class Instance:
    role: Role
    max_request_bytes = rpc.MAX_MESSAGE_BYTES  # the largest request its gRPC server takes
    client_certs = True  # with TLS on: only peers with the mesh's certificates may call it
    rpc_thread_init: Callable[[], None] | None = None  # first on each gRPC thread (an engine's host: torch on one)
    loop: LoopThread | None = None  # set: its gRPC server is grpc.aio's, on this loop (`rpc.start_server`)

    def __init__(self, settings: ServiceSettings, instance_id: str | None = None,
                 registry: Registry | None = None) -> None:
        self.settings = settings
        self.id = instance_id or f"{self.role.value}-{uuid.uuid4().hex[:8]}"
        self.registry = registry or connect_registry(settings.registry)
        self.state = InstanceState.STARTING
        self.address = ""
        self.server = self.health = self.health_server = self.heartbeat = None
        self.metrics = Metrics(self.role.value, settings.metrics, settings.metrics_interval_s)
        self._lock = threading.Lock()  # transitions
        self._draining = False  # a drain began (it ends in stop)
        self._stopped = threading.Event()

    # ---- what a service adds --------------------------------------------------------------

    def describe(self) -> dict:
        """The service's fields of its registry record (load, layout, KV blocks, ...)."""
        return {}

    def in_flight(self) -> int:
        """Work admitted and not finished yet; a drain waits for it to reach 0."""
        return 0

    def status(self) -> internal_pb2.InstanceStatus:
        """Admin.Status: the record, plus whatever else the service reports."""
        return to_message(self.record())

    def close(self) -> None:
        """Stop what the service owns (engine, ranks, transports); called once, by `stop()`."""

    def run(self, until: threading.Event) -> None:
        """What the process's main thread does until `until` is set: a service with an engine drives it."""
        until.wait()

    # ---- lifecycle --------------------------------------------------------------------------

    def count_engine(self, engine) -> None:
        """What every engine instance counts (an `engine.core.EngineCore`): the prompt tokens it computed and,
        with a KV pool, the pool's work."""
        m, tier = self.metrics, engine.kv_tier
        m.counted("infermesh_prompt_tokens_computed", "{token}", "Prompt tokens this instance computed (not found "
                  "in its prefix cache or the KV pool)", lambda: engine.prompt_tokens_computed)
        if tier is None:
            return
        m.counted("infermesh_kv_pool_loaded_tokens", "{token}", "Prompt tokens loaded from the KV pool",
                  lambda: tier.loaded_tokens)
        m.counted("infermesh_kv_pool_stored_tokens", "{token}", "Tokens of full blocks given to the KV pool",
                  lambda: tier.stored_tokens)
        m.counted("infermesh_kv_pool_errors", "{error}", "KV pool lookups, loads and stores that failed or were "
                  "late (the engine computed instead)", lambda: tier.pool.errors)
        tier.pool.on_lookup = m.seconds("infermesh_kv_pool_lookup_seconds",
                                        "Time to look a prompt's blocks up in the KV pool").record

    def serve(self, services: Sequence[tuple[Callable, object, str]],
              block_hashes: Callable[[], set[int]] | None = None) -> None:
        """Start the gRPC server with `services` and Admin, enter SERVING and register (heartbeat)."""
        s = self.settings
        admin = (internal_pb2_grpc.add_AdminServicer_to_server, AdminService(self), "infermesh.v1.Admin")
        self.server, port, self.health = rpc.start_server(s.bind_host or s.host, s.port, [*services, admin],
                                                          serving=False, max_request_bytes=self.max_request_bytes,
                                                          max_concurrent_rpcs=s.max_concurrent_rpcs,
                                                          client_certs=self.client_certs,
                                                          thread_init=self.rpc_thread_init, loop=self.loop)
        self.address = f"{s.host}:{port}"
        if s.health_port is not None:
            self.health_server, _ = rpc.start_health_server(s.bind_host or s.host, s.health_port, self.health)
        self.metrics.serve(s.host, s.metrics_port, s.bind_host)
        with self._lock:
            self._enter(InstanceState.SERVING)
        self.heartbeat = Heartbeat(self.registry, self.record, s.heartbeat_s, s.ttl_s, block_hashes=block_hashes)

    def record(self) -> InstanceInfo:
        return InstanceInfo(id=self.id, role=self.role, address=self.address, pid=os.getpid(),
                            model=self.settings.model, state=self.state, metrics_url=self.metrics.url,
                            **self.describe())

    def admit(self) -> None:
        """The gate of new work: raises `Draining` unless SERVING."""
        state = self.state
        if state is not InstanceState.SERVING:
            raise Draining(f"{self.role.value} instance {self.id} is {state.value}: it takes no new work")

    def fail(self) -> None:
        """The engine failed: DRAINING from now on, and no longer live (`rpc.LIVENESS`): it serves nothing more
        and waits for an operator or a liveness probe to restart it."""
        with self._lock:
            if self.state is InstanceState.SERVING:
                self._enter(InstanceState.DRAINING)
            if self.health is not None:
                self.health.set_alive(False)

    def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new work, wait for in-flight work (at most `timeout_s`, default the setting), stop."""
        if self.begin_drain():
            self.finish_drain(timeout_s)

    def begin_drain(self) -> bool:
        """Enter DRAINING; False when a drain already began or the instance stopped."""
        with self._lock:
            if self._draining or self.state is InstanceState.STOPPED:
                return False
            self._draining = True
            self._enter(InstanceState.DRAINING)
            return True

    def finish_drain(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.settings.drain_timeout_s if timeout_s is None else timeout_s)
        while self.in_flight() and time.monotonic() < deadline and not self._stopped.wait(DRAIN_POLL_S):
            pass
        self.stop()

    def stop(self) -> None:
        with self._lock:
            if self.state is InstanceState.STOPPED:
                return
            self._enter(InstanceState.STOPPED)
        if self.heartbeat is not None:
            self.heartbeat.stop()  # deregisters
        stopping = [server.stop(grace=STOP_GRACE_S) for server in (self.server, self.health_server)
                    if server is not None]
        for stopped in stopping:
            stopped.wait()
        try:
            self.close()
        finally:
            self.metrics.shutdown()  # a last push, after the service's own parts stopped
            self._stopped.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until stopped (True) or `timeout_s` passed (False)."""
        return self._stopped.wait(timeout_s)

    def _enter(self, state: InstanceState) -> None:
        """Under `_lock`: the new state, told to health checks and (at once) to the registry."""
        self.state = state
        if self.health is not None:
            self.health.set_serving(state is InstanceState.SERVING)
        if self.heartbeat is not None and state is not InstanceState.STOPPED:
            self.heartbeat.beat_now()


class AdminService(internal_pb2_grpc.AdminServicer):
    def __init__(self, instance: Instance) -> None:
        self.instance = instance

    def Status(self, request, context):
        return self.instance.status()

    def ListInstances(self, request, context):
        return internal_pb2.ListInstancesResponse(
            instances=[to_message(i) for i in self.instance.registry.instances()])

    def Drain(self, request, context):
        auth.require(self.instance.settings.admin_token, auth.bearer(context.invocation_metadata()), "Admin.Drain")
        if self.instance.begin_drain():
            threading.Thread(target=self.instance.finish_drain, args=(request.timeout_s or None,),
                             name="drain", daemon=True).start()
        return self.instance.status()
