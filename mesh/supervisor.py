"""`infermesh up`: the whole mesh on one host, as processes, in the foreground.

The supervisor serves the in-memory registry over gRPC (unless a Redis URL is
given), starts the expert instances first (prefill and decode attach to them as
they start), then the prefill, decode and router processes (`python -m
<service>.server ...`, each logging to its own file), and is ready when every
instance is registered and the router's health check says SERVING. It stops
every process it started on `stop()` (SIGTERM, then SIGKILL after a grace
period), also when one of them crashed; children die with the supervisor
(`mesh.service.die_with_supervisor`) even if it is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh import rpc
from mesh.registry import Role, connect_registry
from mesh.registry.memory import MemoryRegistry
from mesh.registry.remote import RegistryService
from protos.infermesh.v1 import internal_pb2_grpc


class MeshError(RuntimeError):
    """The mesh could not start or lost a process; the message names it and shows its last log lines."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshSpec:
    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 8000  # the router's public port
    prefill: int = 1
    prefill_cp: int = 1
    decode: int = 1
    decode_tp: int = 1
    local_prefill_max_tokens: int = 64  # the router prefills shorter uncached parts on decode
    kv_transport: str = "grpc_stream"  # or torch_p2p
    http_port: int | None = None  # the router's OpenAI-compatible HTTP front (0: any free port; None: off)
    experts: int = 0  # expert instances hosting the MoE experts (0: each instance runs its own)
    expert_ep: int = 1  # EP ranks per expert instance
    registry: str = "memory"
    trace: str = "none"
    metrics: str = "none"
    dtype: str = "bfloat16"
    kv_cache_bytes: int = 1 << 30
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.decode < 1:
            raise ValueError(f"decode must be >= 1 (someone has to generate), got {self.decode}")
        if self.prefill < 0:
            raise ValueError(f"prefill must be >= 0, got {self.prefill}")
        if self.experts < 0 or self.expert_ep < 1:
            raise ValueError(f"need experts >= 0 and expert_ep >= 1, got {self.experts} and {self.expert_ep}")


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path


class Supervisor:
    def __init__(self, spec: MeshSpec, log_dir: str | None = None) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="infermesh-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.registry_server = None
        self.router_address = ""
        self.http_address = ""  # the router's HTTP front, when asked for

    def start(self) -> str:
        """Start everything and wait until it serves; returns the router's address."""
        s = self.spec
        registry = s.registry
        if registry == "memory":
            self.registry_server, port, _ = rpc.start_server(s.host, 0, [(
                internal_pb2_grpc.add_RegistryServicer_to_server, RegistryService(MemoryRegistry()),
                "infermesh.v1.Registry")])
            registry = f"grpc://{s.host}:{port}"
        common = ["--model", s.model, "--registry", registry, "--trace", s.trace, "--metrics", s.metrics,
                  "--host", s.host]
        engine = ["--dtype", s.dtype, "--kv-cache-bytes", str(s.kv_cache_bytes)]
        try:
            for i in range(s.experts):  # first: prefill and decode instances attach to them as they start
                self._spawn(f"expert-{i}", "expert_svc.server", common + ["--dtype", s.dtype, "--ep", str(s.expert_ep)])
            experts = [e.address for e in self._wait_for(registry, {Role.EXPERT: s.experts}, returning=Role.EXPERT)
                       ] if s.experts else []

            def attach(i: int) -> list[str]:
                return ["--experts", experts[i % len(experts)]] if experts else []

            for i in range(s.prefill):
                self._spawn(f"prefill-{i}", "prefill_svc.server",
                            common + engine + ["--cp", str(s.prefill_cp)] + attach(i))
            for i in range(s.decode):
                self._spawn(f"decode-{i}", "decode_svc.server",
                            common + engine + ["--tp", str(s.decode_tp)] + attach(s.prefill + i))
            http = ["--http-port", str(s.http_port)] if s.http_port is not None else []
            self._spawn("router", "router.server", common + http + [
                "--port", str(s.port), "--local-prefill-max-tokens", str(s.local_prefill_max_tokens),
                "--kv-transport", s.kv_transport])
            (router,) = self._wait_for(registry, {Role.PREFILL: s.prefill, Role.DECODE: s.decode, Role.ROUTER: 1},
                                       returning=Role.ROUTER, healthy=True)
            self.router_address, self.http_address = router.address, router.http_address
        except BaseException:
            self.stop()
            raise
        return self.router_address

    def _spawn(self, name: str, module: str, args: list[str]) -> None:
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:  # no preexec_fn: vfork/exec without fork handlers in this gRPC process
            process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, "INFERMESH_PARENT_PID": str(os.getpid())})
        self.children.append(Child(name, process, log))

    def _wait_for(self, registry_address: str, counts: dict[Role, int], *, returning: Role,
                  healthy: bool = False) -> list:
        """Wait until the registry lists `counts` instances of each role; then the instances of `returning`
        (once they answer health checks, with `healthy`)."""
        deadline = time.monotonic() + self.spec.startup_timeout_s
        registry = connect_registry(registry_address)
        try:
            while time.monotonic() < deadline:
                self.check_children()
                found = registry.instances()
                ready = all(sum(i.role is role for i in found) >= n for role, n in counts.items())
                chosen = sorted((i for i in found if i.role is returning), key=lambda i: i.id)
                if ready and (not healthy or all(_healthy(i.address) for i in chosen)):
                    return chosen
                time.sleep(0.2)
        finally:
            registry.close()
        raise MeshError(f"the mesh was not ready within {self.spec.startup_timeout_s:.0f} s; logs in {self.log_dir}")

    def check_children(self) -> None:
        """Raise MeshError naming the first child that exited."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                tail = "\n".join(child.log.read_text(errors="replace").splitlines()[-15:])
                raise MeshError(f"{child.name} exited with code {code}; last lines of {child.log}:\n{tail}")

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every child (SIGTERM, then SIGKILL); safe to call twice."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        if self.registry_server is not None:
            self.registry_server.stop(None)
            self.registry_server = None


def _healthy(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            request = health_pb2.HealthCheckRequest(service="infermesh.v1.Inference")
            status = health_pb2_grpc.HealthStub(ch).Check(request, timeout=2).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING

