"""The in-memory registry shared over gRPC: `python -m mesh.registry.remote --host H --port P` serves a
`MemoryRegistry` (`RegistryService`; the `infermesh up` supervisor runs it as a child and restarts it on
the same port if it dies), every process of the mesh reaches it with `GrpcRegistry` (spec
`grpc://HOST:PORT`). A restarted registry starts empty and the instances' heartbeats fill it again, as
after a Redis outage."""

from __future__ import annotations

from engine.errors import RequestError
from mesh import rpc
from mesh.registry.base import InstanceInfo, InstanceState, Registry, Role
from mesh.registry.memory import MemoryRegistry
from protos.infermesh.v1 import common_pb2, internal_pb2, internal_pb2_grpc

ROLES = {Role.ROUTER: common_pb2.ROLE_ROUTER, Role.PREFILL: common_pb2.ROLE_PREFILL,
         Role.DECODE: common_pb2.ROLE_DECODE, Role.EXPERT: common_pb2.ROLE_EXPERT,
         Role.SUPERVISOR: common_pb2.ROLE_SUPERVISOR}
STATES = {InstanceState.STARTING: common_pb2.INSTANCE_STATE_STARTING,
          InstanceState.SERVING: common_pb2.INSTANCE_STATE_SERVING,
          InstanceState.DRAINING: common_pb2.INSTANCE_STATE_DRAINING,
          InstanceState.STOPPED: common_pb2.INSTANCE_STATE_STOPPED}


def from_role(role: int) -> Role:
    """The registry role of a wire `Role`; RequestError for UNSPECIFIED or a value no role has."""
    for mine, wire in ROLES.items():
        if wire == role:
            return mine
    raise RequestError(f"role must be one of {', '.join(r.value for r in ROLES)}, got {role}", param="role")


def to_message(info: InstanceInfo) -> internal_pb2.InstanceStatus:
    return internal_pb2.InstanceStatus(
        id=info.id, role=ROLES[info.role], address=info.address, pid=info.pid, model=info.model,
        parallel=common_pb2.ParallelLayout(**info.parallel), state=STATES[info.state],
        active_requests=info.active_requests, total_requests=info.total_requests, kv_blocks_used=info.kv_blocks_used,
        kv_blocks_total=info.kv_blocks_total, block_size=info.block_size, rendezvous=info.rendezvous,
        placement=info.placement, http_address=info.http_address, metrics_url=info.metrics_url)


def from_message(m: internal_pb2.InstanceStatus) -> InstanceInfo:
    return InstanceInfo(
        id=m.id, role=from_role(m.role), address=m.address, pid=m.pid, model=m.model,
        parallel={"tp": m.parallel.tp, "cp": m.parallel.cp, "ep": m.parallel.ep},
        state={v: k for k, v in STATES.items()}[m.state], active_requests=m.active_requests,
        total_requests=m.total_requests, kv_blocks_used=m.kv_blocks_used, kv_blocks_total=m.kv_blocks_total,
        block_size=m.block_size, http_address=m.http_address, metrics_url=m.metrics_url, rendezvous=m.rendezvous,
        placement=tuple(m.placement))


class RegistryService(internal_pb2_grpc.RegistryServicer):
    def __init__(self, registry: MemoryRegistry) -> None:
        self.registry = registry

    def Register(self, request, context):
        self.registry.register(from_message(request.instance), request.ttl_s)
        return internal_pb2.RegistryAck()

    def Deregister(self, request, context):
        self.registry.deregister(request.id)
        return internal_pb2.RegistryAck()

    def ListInstances(self, request, context):
        role = None if request.role == common_pb2.ROLE_UNSPECIFIED else from_role(request.role)
        return internal_pb2.ListInstancesResponse(instances=[to_message(i) for i in self.registry.instances(role)])

    def SetBlockHashes(self, request, context):
        self.registry.set_block_hashes(request.id, set(request.hashes), request.ttl_s)
        return internal_pb2.RegistryAck()

    def PrefixHits(self, request, context):
        return internal_pb2.PrefixHitsResponse(hits=self.registry.prefix_hits(list(request.chain)))

    def Snapshot(self, request, context):
        found, blocks = self.registry.snapshot()
        return internal_pb2.SnapshotResponse(instances=[to_message(i) for i in found], blocks={
            iid: internal_pb2.BlockHashes(hashes=sorted(hashes)) for iid, hashes in blocks.items()})


class GrpcRegistry(Registry):
    TIMEOUT_S = 5.0

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = rpc.channel(address)
        self._stub = internal_pb2_grpc.RegistryStub(self._channel)

    def register(self, info: InstanceInfo, ttl_s: float) -> None:
        self._stub.Register(internal_pb2.RegisterRequest(instance=to_message(info), ttl_s=ttl_s),
                            timeout=self.TIMEOUT_S)

    def deregister(self, instance_id: str) -> None:
        self._stub.Deregister(internal_pb2.DeregisterRequest(id=instance_id), timeout=self.TIMEOUT_S)

    def instances(self, role: Role | None = None) -> list[InstanceInfo]:
        request = internal_pb2.ListInstancesRequest(role=ROLES[role] if role else common_pb2.ROLE_UNSPECIFIED)
        return [from_message(m) for m in self._stub.ListInstances(request, timeout=self.TIMEOUT_S).instances]

    def set_block_hashes(self, instance_id: str, hashes: set[int], ttl_s: float) -> None:
        request = internal_pb2.SetBlockHashesRequest(id=instance_id, hashes=sorted(hashes), ttl_s=ttl_s)
        self._stub.SetBlockHashes(request, timeout=self.TIMEOUT_S)

    def prefix_hits(self, chain: list[int]) -> dict[str, int]:
        return dict(self._stub.PrefixHits(internal_pb2.PrefixHitsRequest(chain=chain), timeout=self.TIMEOUT_S).hits)

    def snapshot(self) -> tuple[list[InstanceInfo], dict[str, frozenset[int]]]:
        answer = self._stub.Snapshot(internal_pb2.SnapshotRequest(), timeout=self.TIMEOUT_S)
        return ([from_message(m) for m in answer.instances],
                {iid: frozenset(b.hashes) for iid, b in answer.blocks.items()})

    def close(self) -> None:
        self._channel.close()


def main(argv: list[str] | None = None) -> None:
    """Serve an in-memory registry on --host:--port until SIGINT/SIGTERM (or the `infermesh up` parent dies)."""
    import argparse
    import os
    import signal
    import threading

    from engine.parallel.lifetime import die_with_parent

    parser = argparse.ArgumentParser(prog="python -m mesh.registry.remote")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    if "INFERMESH_PARENT_PID" in os.environ:
        die_with_parent(int(os.environ["INFERMESH_PARENT_PID"]))
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    server, port, _ = rpc.start_server(args.host, args.port, [(internal_pb2_grpc.add_RegistryServicer_to_server,
                                                               RegistryService(MemoryRegistry()),
                                                               "infermesh.v1.Registry")])
    print(f"registry serving on {args.host}:{port}", flush=True)
    done.wait()
    server.stop(None)


if __name__ == "__main__":
    main()
