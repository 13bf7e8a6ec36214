"""Redis, the registry across hosts, killed (SIGKILL) under a serving mesh and started again empty on the
same port: during the outage the router routes on the last instances it read and every request is served
with the engine's tokens; once Redis is back, every instance has registered again by its heartbeat and
the mesh serves on. Real redis-server, real gRPC instances."""

from __future__ import annotations

import signal

import pytest

from decode_svc.server import DecodeInstance
from engine import LLM
from engine.errors import Unavailable
from mesh.registry import InstanceInfo, MemoryRegistry, Role, connect_registry
from mesh.registry.last_known import LastKnown
from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from router.server import RouterInstance
from tests.conftest import free_port, start_redis
from tests.test_lifecycle import wait_until
from tests.test_router import GREEDY, generate


def test_the_mesh_serves_through_a_redis_restart_and_registers_again(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    port = free_port()
    redis_process = start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22, registry=url)
    instances = [PrefillInstance(PrefillSettings(**common)), DecodeInstance(DecodeSettings(**common)),
                 RouterInstance(RouterSettings(model=str(folder), registry=url, local_prefill_max_tokens=8))]
    router = instances[2]
    watcher = connect_registry(url)
    reference = LLM(str(folder), dtype="float32")
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16][: 4 + 2 * i] for i in range(5)]  # local and not
    expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    try:
        wait_until(lambda: {i.role for i in watcher.instances()} == {Role.PREFILL, Role.DECODE, Role.ROUTER})
        assert [generate(router.address, p)[0] for p in prompts] == expected

        redis_process.send_signal(signal.SIGKILL)
        redis_process.wait()
        assert [generate(router.address, p)[0] for p in prompts] == expected  # on the last snapshot

        redis_process = start_redis(port, tmp_path)  # empty: nothing was saved
        wait_until(lambda: {i.id for i in watcher.instances()} == {i.id for i in instances}, timeout_s=30)
        assert [generate(router.address, p)[0] for p in prompts] == expected
    finally:
        for instance in instances:
            instance.stop()
        watcher.close()
        redis_process.kill()
        redis_process.wait()


def test_a_router_that_never_read_the_registry_says_so():
    class Down(MemoryRegistry):
        def instances(self, role=None):
            raise ConnectionError("connection refused")

        def prefix_hits(self, chain):
            raise ConnectionError("connection refused")

    with pytest.raises(Unavailable, match="the registry is unreachable and this router has not read it yet"):
        LastKnown(Down()).instances(Role.DECODE)
    assert LastKnown(Down()).prefix_hits([1, 2]) == {}

    with pytest.raises(Unavailable, match="has not read it yet"):
        LastKnown(Down()).instances_and_hits([1, 2])


def test_the_combined_read_answers_the_last_instances_and_no_hits_while_the_registry_is_down():
    class Flaky(MemoryRegistry):
        down = False

        def instances(self, role=None):
            if self.down:
                raise ConnectionError("connection refused")
            return super().instances(role)

    flaky = Flaky()
    flaky.register(InstanceInfo(id="d1", role=Role.DECODE, address="127.0.0.1:1", pid=1, model="m"), ttl_s=30)
    flaky.set_block_hashes("d1", {5}, ttl_s=30)
    registry = LastKnown(flaky)
    live, hits = registry.instances_and_hits([5, 6])
    assert [i.id for i in live] == ["d1"] and hits == {"d1": 1}
    flaky.down = True
    assert registry.instances_and_hits([5, 6]) == (live, {})
