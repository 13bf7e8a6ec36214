"""The registry contract, passed by every implementation: in-memory, Redis (a real redis-server), the
in-memory one served over gRPC, and the router's snapshot of one."""

from __future__ import annotations

import pytest

from mesh.registry import InstanceInfo, InstanceState, Role, connect_registry
from tests.helpers import wait_until


@pytest.fixture(params=["memory", "redis", "grpc", "snapshot"])
def registry(request):
    if request.param == "memory":
        reg = connect_registry("memory")
    elif request.param == "snapshot":  # the router's: read on every call (stale at once), hits counted in memory
        from mesh.registry.snapshot import Snapshot

        reg = Snapshot(connect_registry("memory"), stale_s=0.0)
    elif request.param == "grpc":  # a memory registry served over gRPC, as `infermesh up` does
        from mesh.registry.memory import MemoryRegistry
        from mesh.registry.remote import RegistryService
        from mesh.rpc import start_server
        from protos.infermesh.v1 import internal_pb2_grpc

        server, port, _ = start_server("127.0.0.1", 0, [(internal_pb2_grpc.add_RegistryServicer_to_server,
                                                         RegistryService(MemoryRegistry()), "infermesh.v1.Registry")])
        request.addfinalizer(lambda: server.stop(None))
        reg = connect_registry(f"grpc://127.0.0.1:{port}")
    else:
        url = request.getfixturevalue("redis_url")
        reg = connect_registry(url)
        reg._redis.flushdb()
    yield reg
    reg.close()
    reg.close()  # safe twice


def info(iid: str, role: Role = Role.DECODE, **fields) -> InstanceInfo:
    return InstanceInfo(id=iid, role=role, address=f"127.0.0.1:{5000 + len(iid)}", pid=123, model="smollm2-135m",
                        **fields)


def test_registered_instances_are_listed_by_role_with_their_record(registry):
    registry.register(info("d1", kv_blocks_total=100, parallel={"tp": 2, "cp": 1, "ep": 1}), ttl_s=30)
    registry.register(info("p1", Role.PREFILL), ttl_s=30)
    assert [i.id for i in registry.instances()] == ["d1", "p1"]
    (d1,) = registry.instances(Role.DECODE)
    assert d1 == info("d1", kv_blocks_total=100, parallel={"tp": 2, "cp": 1, "ep": 1})
    assert registry.instances(Role.EXPERT) == []
    expert = info("e1", Role.EXPERT, rendezvous="127.0.0.1:7000", placement=(0, 0, 1, 1))
    registry.register(expert, ttl_s=30)
    assert registry.instances(Role.EXPERT) == [expert]  # with its placement and rendezvous


def test_registering_again_replaces_the_record(registry):
    registry.register(info("d1"), ttl_s=30)
    registry.register(info("d1", state=InstanceState.SERVING, active_requests=3), ttl_s=30)
    (d1,) = registry.instances()
    assert d1.state is InstanceState.SERVING and d1.active_requests == 3


def test_an_instance_that_stops_renewing_disappears_after_its_ttl(registry):
    registry.register(info("short"), ttl_s=0.3)
    registry.register(info("long"), ttl_s=30)
    registry.set_block_hashes("short", {1, 2}, ttl_s=0.3)
    wait_until(lambda: [i.id for i in registry.instances()] == ["long"], timeout_s=10)
    assert registry.prefix_hits([1, 2]) == {"long": 0}


def test_deregistered_instances_and_their_blocks_are_gone(registry):
    registry.register(info("d1"), ttl_s=30)
    registry.set_block_hashes("d1", {7}, ttl_s=30)
    registry.deregister("d1")
    registry.deregister("d1")  # no-op
    assert registry.instances() == [] and registry.prefix_hits([7]) == {}


def test_prefix_hits_count_leading_blocks_held(registry):
    for iid in ("a", "b", "c"):
        registry.register(info(iid), ttl_s=30)
    registry.set_block_hashes("a", {11, 12, 13}, ttl_s=30)
    registry.set_block_hashes("b", {11, 13}, ttl_s=30)  # a gap: only the first counts
    chain = [11, 12, 13, 14]
    assert registry.prefix_hits(chain) == {"a": 3, "b": 1, "c": 0}
    registry.set_block_hashes("a", set(), ttl_s=30)  # replaced, not merged
    assert registry.prefix_hits(chain)["a"] == 0
    assert registry.prefix_hits([]) == {"a": 0, "b": 0, "c": 0}


def test_a_bad_registry_spec_is_refused():
    with pytest.raises(ValueError, match="registry must be 'memory', 'redis://HOST:PORT' or 'grpc://HOST:PORT', got 'etcd://x'"):
        connect_registry("etcd://x")


def test_instances_and_hits_read_together_equal_the_two_reads(registry):
    registry.register(info("d1"), ttl_s=30)
    registry.register(info("p1", Role.PREFILL), ttl_s=30)
    registry.set_block_hashes("d1", {11, 12}, ttl_s=30)
    assert registry.instances_and_hits([11, 12, 13]) == (registry.instances(), {"d1": 2, "p1": 0})
    assert registry.instances_and_hits([]) == (registry.instances(), {})  # no hits to read for no blocks
    registry.deregister("d1")
    assert registry.instances_and_hits([11]) == ([info("p1", Role.PREFILL)], {"p1": 0})


def test_a_snapshot_holds_every_instance_and_the_block_hashes_each_holds(registry):
    registry.register(info("d1"), ttl_s=30)
    registry.register(info("p1", Role.PREFILL), ttl_s=30)
    registry.set_block_hashes("d1", {11, 2**64 - 1}, ttl_s=30)  # the full fixed64 range
    assert registry.snapshot() == (registry.instances(), {"d1": frozenset({11, 2**64 - 1}), "p1": frozenset()})
    registry.deregister("d1")
    assert registry.snapshot() == ([info("p1", Role.PREFILL)], {"p1": frozenset()})
