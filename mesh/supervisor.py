"""`infermesh up`: the whole mesh on one host, as processes, in the foreground.

The supervisor serves its control service (`Supervisor.Scale`, `Supervisor.Processes`) and its metrics,
and registers itself with role `supervisor`. Unless a Redis URL is given it starts the in-memory registry
first (`python -m mesh.registry.remote`, a child on a port fixed for its life), then the expert instances
(prefill and decode attach to them as they start), then the prefill, decode and router processes
(`python -m <service>.server ...`, each logging to its own file), and is ready when every instance is
registered and the router's health check says SERVING. With `cpus="split"` (the default)
each engine instance runs on its own share of the host's cores (`engine.cpus.share`, by ranks; its
`--cpus`), and a decode instance of one rank may run a step on the prefill instances' cores while they idle
(`--borrow-cpus`, engine.cpu_lending); the router and the supervisor run on any.

It owns every process it started, scaled ones included (`mesh.children`). `scale(role, n)` starts
instances of a role or drains its newest ones (`Admin.Drain`: finish in-flight work, deregister, exit)
until it has n. While the mesh starts, a process that exits fails the start (MeshError naming it and
its log). Once it serves, `watch()` keeps it serving: a child that exits 0 left cleanly (drained) and is
let go; one that crashes is restarted with the same argv, so on the same cores and, for the router and
the registry, the same port (back-off and limit: `mesh.restarts`), counted in
`infermesh_instance_restarts_total{role}`; the router's migration carries the streams a dead decode
instance held. `watch()` raises MeshError only when a role the mesh cannot serve without (decode,
router, expert when the mesh has expert instances) has no process left that will ever serve again.
`stop()` stops every process (SIGTERM, then SIGKILL after a grace period); children die with the
supervisor (PR_SET_PDEATHSIG) even if it is killed.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.cpus import available_cores, format_cpus, share
from engine.errors import RequestError, Unsupported
from kvtransfer import pool_processes
from mesh import auth, rpc
from mesh.children import Child, Children, ProcessState
from mesh.mesh_spec import MeshSpec
from mesh.metrics import Metrics
from mesh.registry import InstanceInfo, InstanceState, Role, connect_registry
from mesh.registry.remote import from_role
from mesh.service import Heartbeat
from mesh.settings import (
    DecodeSettings,
    ExpertSettings,
    PrefillSettings,
    RankedSettings,
    RouterSettings,
    ServiceSettings,
    load,
    to_flags,
)
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc


class MeshError(RuntimeError):
    """The mesh could not start or lost a process; the message names it and shows its last log lines."""


SCALABLE = (Role.PREFILL, Role.DECODE)
MODULES = {Role.PREFILL: "prefill_svc.server", Role.DECODE: "decode_svc.server", Role.EXPERT: "expert_svc.server",
           Role.ROUTER: "router.server"}  # each role's service, started by module name
KINDS = (*(role.value for role in MODULES), "registry", "kv-pool")  # what a child of the mesh may be


class Supervisor:
    def __init__(self, spec: MeshSpec, log_dir: str | None = None) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="infermesh-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = Metrics("supervisor", spec.metrics)
        self._restarts = self.metrics.counter("infermesh_instance_restarts", "{restart}",
                                              "Processes of the mesh restarted after a crash, by role",
                                              zeros=tuple({"role": kind} for kind in KINDS))
        self.children = Children(spec.restart_policy(),
                                 on_restart=lambda child: self._restarts.add(1, {"role": child.kind}))
        self.server = self.heartbeat = None
        self.registry_address = spec.registry
        self.router_address = ""
        self.http_address = ""  # the router's HTTP front, when asked for
        self._serving = False  # started: a crash is restarted, no longer a failed start
        self._scaling = threading.Lock()  # one scale at a time
        self._settings: dict[Role, ServiceSettings] = {}  # role -> what its instances load
        self._numbers = {role: itertools.count() for role in SCALABLE}  # names: prefill-0, prefill-1, ...
        self._attached = itertools.count()  # instances attach to the expert instances round-robin
        self._experts: list[str] = []
        self._cores: dict[Role, list[list[int]]] = {}  # role -> each planned instance's cores (cpus=split)

    def start(self) -> str:
        """Start everything and wait until it serves; returns the router's address."""
        s = self.spec
        self.server, port, _ = rpc.start_server(s.host, 0, [(internal_pb2_grpc.add_SupervisorServicer_to_server,
                                                             SupervisorService(self), "infermesh.v1.Supervisor")])
        address = f"{s.host}:{port}"
        self.metrics.serve(s.host, 0)
        try:
            if s.registry == "memory":
                self.registry_address = self._start_registry()
            self._start_instances()
        except BaseException:
            self.stop()
            raise
        self.heartbeat = Heartbeat(connect_registry(self.registry_address), lambda: InstanceInfo(
            id=f"supervisor-{os.getpid()}", role=Role.SUPERVISOR, address=address, pid=os.getpid(),
            model=s.model, state=InstanceState.SERVING, metrics_url=self.metrics.url), interval_s=1.0, ttl_s=5.0)
        self._serving = True
        return self.router_address

    def _start_instances(self) -> None:
        s = self.spec
        common = dict(model=s.model, registry=self.registry_address, trace=s.trace, metrics=s.metrics, host=s.host)
        kv_pool = self._start_pool() if s.kv_pool == "mooncake" else s.kv_pool
        engine = dict(common, dtype=s.dtype, quantization=s.quantization, kv_cache_bytes=s.kv_cache_bytes,
                      batch_invariant=s.batch_invariant, max_num_batched_tokens=s.max_num_batched_tokens,
                      mooncake_protocol=s.mooncake_protocol, mooncake_devices=s.mooncake_devices, kv_pool=kv_pool)
        self._settings = {  # what each role's instances load (the environment fills what the spec leaves out)
            Role.PREFILL: load(PrefillSettings, dict(engine, cp=s.prefill_cp,  # decode reads its KV cache in place:
                                                     shared_kv_cache=s.kv_transport == "shared_memory")),
            Role.DECODE: load(DecodeSettings, dict(engine, tp=s.decode_tp)),
            Role.EXPERT: load(ExpertSettings, dict(common, dtype=s.dtype, ep=s.expert_ep)),
            Role.ROUTER: load(RouterSettings, dict(common, port=s.port, kv_transport=s.kv_transport,
                                                   local_prefill_max_tokens=s.local_prefill_max_tokens,
                                                   **({} if s.http_port is None else {"http_port": s.http_port}))),
        }
        self._cores = self._plan_cores()
        for i in range(s.experts):  # first: prefill and decode instances attach to them as they start
            self._spawn(f"expert-{i}", Role.EXPERT, self._instance_settings(Role.EXPERT, i))
        if s.experts:
            self._experts = [e.address for e in self._wait_for({Role.EXPERT: s.experts}, returning=Role.EXPERT)]
        for role, count in ((Role.PREFILL, s.prefill), (Role.DECODE, s.decode)):
            for _ in range(count):
                self._spawn_instance(role)
        child = self._spawn("router", Role.ROUTER, self._settings[Role.ROUTER])
        (router,) = self._wait_for({Role.PREFILL: s.prefill, Role.DECODE: s.decode, Role.ROUTER: 1},
                                   returning=Role.ROUTER, healthy=True)
        self.router_address, self.http_address = router.address, router.http_address
        # restarted, the router binds the ports it has now (those of port 0 included): its clients find it again
        child.argv = self._argv(Role.ROUTER, dataclasses.replace(
            self._settings[Role.ROUTER], port=_port(router.address),
            http_port=_port(router.http_address) if router.http_address else None), child.environment)

    def _plan_cores(self) -> dict[Role, list[list[int]]]:
        """cpus=split: this host's cores shared among the engine instances by their ranks (decode first: the
        rounding favours it; an instance with fewer cores than ranks runs its ranks on the same cores);
        cpus=shared: none planned, every instance may use every core."""
        s = self.spec
        if s.cpus == "shared":
            return {}
        instances = ([(Role.DECODE, s.decode_tp)] * s.decode + [(Role.PREFILL, s.prefill_cp)] * s.prefill
                     + [(Role.EXPERT, s.expert_ep)] * s.experts)
        plan: dict[Role, list[list[int]]] = {}
        for (role, _), cores in zip(instances, share(available_cores(), [ranks for _, ranks in instances])):
            plan.setdefault(role, []).append(cores)
        return plan

    def _cpus(self, role: Role, number: int) -> dict[str, str]:
        """The cores of the role's instance `number` (cpus=split), as its settings' `cpus` and `borrow_cpus`; one
        started by `scale` past the plan shares the cores of a planned instance of its role in turn (none
        planned: every core). A decode instance of one rank may borrow the prefill instances' cores."""
        cores = self._cores[role][number % len(self._cores[role])] if self._cores.get(role) else []
        if not cores:
            return {}
        lendable = {core for share in self._cores.get(Role.PREFILL, []) for core in share} - set(cores)
        if role is Role.DECODE and self.spec.decode_tp == 1 and lendable:
            return {"cpus": format_cpus(cores), "borrow_cpus": format_cpus(lendable)}
        return {"cpus": format_cpus(cores)}

    def _instance_settings(self, role: Role, number: int) -> RankedSettings:
        """The settings of the role's instance `number`: its cores and, for prefill and decode, the expert
        instance it attaches to (round-robin)."""
        attach = {"experts": self._experts[next(self._attached) % len(self._experts)]} \
            if role in SCALABLE and self._experts else {}
        return dataclasses.replace(self._settings[role], **self._cpus(role, number), **attach)

    def _spawn_instance(self, role: Role) -> Child:
        number = next(self._numbers[role])
        return self._spawn(f"{role.value}-{number}", role, self._instance_settings(role, number))

    def _environment(self) -> dict[str, str]:
        """A child's: this process's, its parent pid, the admin token (never on a command line, where ps shows it)."""
        token = {auth.ADMIN_TOKEN_ENV: self.spec.admin_token} if self.spec.admin_token else {}
        return {**os.environ, "INFERMESH_PARENT_PID": str(os.getpid()), **token}

    def _spawn(self, name: str, role: Role, settings: ServiceSettings) -> Child:
        environment = self._environment()
        return self._run(name, role.value, self._argv(role, settings, environment), environment)

    @staticmethod
    def _argv(role: Role, settings: ServiceSettings, environment: dict[str, str]) -> list[str]:
        """`python -m <role's service> <its flags>`, rendered from `settings` (mesh.settings.to_flags)."""
        return [sys.executable, "-m", MODULES[role], *to_flags(settings, environment)]

    def _start_registry(self) -> str:
        """The in-memory registry, a child on a port of its own; its `grpc://` address once it listens."""
        host, (port,) = self.spec.host, _free_ports(self.spec.host, 1)
        self._run("registry", "registry", [sys.executable, "-m", "mesh.registry.remote", "--host", host,
                                           "--port", str(port)], self._environment())
        self._wait_listening(host, port)
        return f"grpc://{host}:{port}"

    def _start_pool(self) -> str:
        """The embedded KV pool (`--kv-pool mooncake`): Mooncake Store's master and a client holding the pool's
        memory, children like the instances; its `mooncake://` address once both listen."""
        host, (port, metrics_port, memory_port) = self.spec.host, _free_ports(self.spec.host, 3)
        self._run("kv-pool-master", "kv-pool", pool_processes.master(host, port, metrics_port), self._environment())
        self._wait_listening(host, port)
        self._run("kv-pool-memory", "kv-pool", pool_processes.memory(host, memory_port, port, self.spec.kv_pool_memory),
                  self._environment())
        self._wait_listening(host, memory_port)
        return f"mooncake://{host}:{port}"

    def _wait_listening(self, host: str, port: int) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            self._fail_if_exited()
            with socket.socket() as s:
                if s.connect_ex((host, port)) == 0:
                    return
            time.sleep(0.1)
        raise MeshError(f"nothing listened on {host}:{port} within {self.spec.startup_timeout_s:.0f} s; "
                        f"logs in {self.log_dir}")

    def _run(self, name: str, kind: str, argv: list[str], environment: dict[str, str]) -> Child:
        return self.children.run(name, kind, argv, environment, self.log_dir / f"{name}.log")

    def _fail_if_exited(self) -> None:
        """While the mesh starts, a process that exited fails the start: MeshError naming it and its log."""
        if not self._serving and (child := self.children.exited()) is not None:
            raise MeshError(f"{child.name} exited with code {child.process.returncode}; "
                            f"last lines of {child.log}:\n{child.tail()}")

    def _wait_for(self, counts: dict[Role, int], *, returning: Role, healthy: bool = False,
                  exactly: bool = False) -> list[InstanceInfo]:
        """Wait until the registry lists `counts` serving instances of each role (at least, or `exactly`);
        then the instances of `returning` (once they answer health checks, with `healthy`)."""
        deadline = time.monotonic() + self.spec.startup_timeout_s
        registry = connect_registry(self.registry_address)
        try:
            while time.monotonic() < deadline:
                self._fail_if_exited()
                found = [i for i in registry.instances() if i.state is InstanceState.SERVING]
                have = {role: sum(i.role is role for i in found) for role in counts}
                ready = all(have[role] == n if exactly else have[role] >= n for role, n in counts.items())
                chosen = sorted((i for i in found if i.role is returning), key=lambda i: i.id)
                if ready and (not healthy or all(_healthy(i.address) for i in chosen)):
                    return chosen
                time.sleep(0.2)
        finally:
            registry.close()
        raise MeshError(f"the mesh was not ready within {self.spec.startup_timeout_s:.0f} s; logs in {self.log_dir}")

    def scale(self, role: Role, instances: int, drain_timeout_s: float = 60.0) -> tuple[list[str], list[str]]:
        """Start or drain instances of `role` until it has `instances`; (ids started, ids drained)."""
        if role not in SCALABLE:
            raise Unsupported(f"scale supports prefill and decode instances, not {role.value}")
        if instances < (1 if role is Role.DECODE else 0):
            raise RequestError(f"instances of {role.value} must be >= {1 if role is Role.DECODE else 0}, "
                               f"got {instances}", param="instances")
        with self._scaling:
            mine = self.children.alive(role.value)  # running, or back after their back-off
            if instances > len(mine):
                started = [self._spawn_instance(role) for _ in range(instances - len(mine))]
                found = self._wait_for({role: instances}, returning=role)
                return [i.id for i in found if i.pid in {c.process.pid for c in started}], []
            leaving = [c for c in mine[instances:] if not self.children.retire(c)]  # the newest running ones
            records = {i.pid: i for i in self._registry_instances(role)}
            for child in leaving:
                if child.process.pid in records:
                    internal_pb2_grpc.AdminStub(rpc.channel(records[child.process.pid].address)).Drain(
                        internal_pb2.DrainRequest(timeout_s=drain_timeout_s), timeout=10)
            for child in leaving:  # exit 0: `watch` lets them go
                child.process.wait(timeout=drain_timeout_s + 30)
            return [], [records[c.process.pid].id for c in leaving if c.process.pid in records]

    def _registry_instances(self, role: Role) -> list[InstanceInfo]:
        registry = connect_registry(self.registry_address)
        try:
            return registry.instances(role)
        finally:
            registry.close()

    def watch(self) -> list[str]:
        """One round of supervision (`mesh.children`): what happened, one line per event. MeshError when a role
        the mesh cannot serve without has no process left that will ever serve (after its last one's log)."""
        events = self.children.watch()
        required = {Role.DECODE.value, Role.ROUTER.value} | ({Role.EXPERT.value} if self.spec.experts else set())
        for kind in sorted(required):
            if not self.children.alive(kind):
                last = [c for c in self.children.all() if c.kind == kind][-1]
                raise MeshError("\n".join([*events, f"no {kind} instance left that can serve: {last.name} "
                                                      f"{last.reason}; last lines of {last.log}:", last.tail()]))
        return events

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every child (SIGTERM, then SIGKILL); safe to call twice."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        self.children.stop(grace_s)
        if self.server is not None:
            self.server.stop(None)
            self.server = None
        self.metrics.shutdown()


class SupervisorService(internal_pb2_grpc.SupervisorServicer):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def Scale(self, request, context):
        auth.require(self.supervisor.spec.admin_token, auth.bearer(context.invocation_metadata()), "Supervisor.Scale")
        role = from_role(request.role)
        started, drained = self.supervisor.scale(role, request.instances)
        return internal_pb2.ScaleResponse(started=started, drained=drained, instances=request.instances)

    def Processes(self, request, context):
        return internal_pb2.ProcessesResponse(processes=[
            internal_pb2.ProcessStatus(name=c.name, kind=c.kind, pid=c.process.pid, state=PROCESS_STATES[c.state],
                                       restarts=len(c.restarted_at), last_exit=c.last_exit, reason=c.reason)
            for c in self.supervisor.children.all()])


PROCESS_STATES = {ProcessState.RUNNING: internal_pb2.PROCESS_STATE_RUNNING,
                  ProcessState.RESTARTING: internal_pb2.PROCESS_STATE_RESTARTING,
                  ProcessState.DOWN: internal_pb2.PROCESS_STATE_DOWN}


def _healthy(address: str) -> bool:
    with rpc.channel(address) as ch:
        try:
            request = health_pb2.HealthCheckRequest(service="infermesh.v1.Inference")
            status = health_pb2_grpc.HealthStub(ch).Check(request, timeout=2).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


def _port(address: str) -> int:
    return urlsplit(f"//{address}").port


def _free_ports(host: str, n: int) -> list[int]:
    """`n` ports free on `host` now (held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
