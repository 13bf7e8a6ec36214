"""Redis, the registry across hosts, killed (SIGKILL) under a serving mesh and started again empty on the
same port: during the outage the router routes on the last instances it read and every request is served
with the engine's tokens; once Redis is back, every instance has registered again by its heartbeat and
the mesh serves on. Real redis-server, real gRPC instances. And the router's snapshot of the registry
(`mesh.registry.snapshot`): answered from memory, read again behind the requests, read on the request
when it has no serving decode instance, kept through an outage; a read that hangs holds up only the request
that waits for it."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_svc.server import DecodeInstance
from engine import LLM, SamplingParams
from engine.errors import Unavailable
from mesh.registry import InstanceInfo, InstanceState, MemoryRegistry, Role, connect_registry
from mesh.registry.snapshot import Snapshot
from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from router.server import RouterInstance
from tests.conftest import start_redis
from tests.helpers import free_port, wait_until
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


class Counting(MemoryRegistry):
    """A memory registry that counts the snapshots asked of it and can be down."""

    reads = 0
    down = False

    def snapshot(self):
        self.reads += 1
        if self.down:
            raise ConnectionError("connection refused")
        return super().snapshot()


def decode(iid: str, state: InstanceState = InstanceState.SERVING) -> InstanceInfo:
    return InstanceInfo(id=iid, role=Role.DECODE, address="127.0.0.1:1", pid=1, model="m", state=state)


def test_the_router_routes_from_memory_and_reads_the_registry_again_in_the_background():
    registry = Counting()
    registry.register(decode("d1"), ttl_s=30)
    registry.set_block_hashes("d1", {5, 6}, ttl_s=30)
    view = Snapshot(registry, refresh_s=60)
    assert view.instances_and_hits([5, 7]) == ([decode("d1")], {"d1": 1}) and registry.reads == 1
    registry.register(decode("d2"), ttl_s=30)
    for _ in range(20):  # a request's reads come from memory while the snapshot is younger than refresh_s
        assert [i.id for i in view.instances()] == ["d1"]
    assert registry.reads == 1

    eager = Snapshot(registry, refresh_s=1e-9)
    assert [i.id for i in eager.instances()] == ["d1", "d2"]  # the first read, on the request's path
    registry.register(decode("d3"), ttl_s=30)
    assert [i.id for i in eager.instances()] == ["d1", "d2"]  # answered at once; the new read runs behind it
    wait_until(lambda: [i.id for i in eager.instances()] == ["d1", "d2", "d3"])


def test_a_snapshot_without_a_serving_decode_instance_is_read_again_on_the_request():
    registry = Counting()
    registry.register(decode("d1", InstanceState.DRAINING), ttl_s=30)
    view = Snapshot(registry, refresh_s=60)
    assert [i.state for i in view.instances()] == [InstanceState.DRAINING]
    registry.register(decode("d2"), ttl_s=30)  # a decode instance comes up
    assert [i.id for i in view.instances()] == ["d1", "d2"] and registry.reads == 2
    view.instances()
    assert registry.reads == 2  # one serves now: from memory again


def test_a_router_that_never_read_the_registry_says_so():
    registry = Counting()
    registry.down = True
    with pytest.raises(Unavailable, match="the registry is unreachable and this router has not read it yet"):
        Snapshot(registry).instances(Role.DECODE)
    assert Snapshot(registry).prefix_hits([1, 2]) == {}
    with pytest.raises(Unavailable, match="has not read it yet"):
        Snapshot(registry).instances_and_hits([1, 2])


def test_while_the_registry_is_down_the_last_snapshot_answers_and_reads_wait_retry_s():
    registry = Counting()
    registry.register(decode("d1"), ttl_s=30)
    registry.set_block_hashes("d1", {5}, ttl_s=30)
    view = Snapshot(registry, stale_s=0.0, retry_s=60)  # every request would read the registry itself
    live, hits = view.instances_and_hits([5, 6])
    assert [i.id for i in live] == ["d1"] and hits == {"d1": 1}
    registry.down = True
    for _ in range(5):
        assert view.instances_and_hits([5, 6]) == (live, {"d1": 1})  # the last instances and block hashes
    assert registry.reads == 2  # one failed read, then none before retry_s


def test_a_background_read_that_fails_keeps_the_snapshot_and_the_next_one_catches_up():
    registry = Counting()
    registry.register(decode("d1"), ttl_s=30)
    view = Snapshot(registry, refresh_s=1e-9, retry_s=60)
    assert [i.id for i in view.instances()] == ["d1"]
    registry.down = True
    assert [i.id for i in view.instances()] == ["d1"]  # answered from memory; its background read fails
    wait_until(lambda: registry.reads >= 2)
    registry.down = False
    registry.register(decode("d2"), ttl_s=30)
    wait_until(lambda: [i.id for i in view.instances()] == ["d1", "d2"])  # a later request's background read


class Hanging(MemoryRegistry):
    """A memory registry whose reads can hang: a registry host partitioned away (no answer, no error)."""

    def __init__(self) -> None:
        super().__init__()
        self.answering = threading.Event()
        self.answering.set()
        self.hung = 0  # reads waiting for an answer

    def snapshot(self):
        self.hung += 1
        self.answering.wait()
        self.hung -= 1
        return super().snapshot()


def test_a_registry_read_that_hangs_stalls_only_the_request_that_waits_for_it(tiny_checkpoint):
    """The router's streams share one event loop: a request whose route waits for a registry that does not
    answer waits alone (its read runs on a thread), a stream in flight streams to its end meanwhile, and
    once the registry answers the waiting request is served."""
    folder, _ = tiny_checkpoint("llama")
    registry = Hanging()
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22)
    decode_instance = DecodeInstance(DecodeSettings(**common), registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder)), registry=registry)
    router.core.registry = Snapshot(registry, stale_s=0.0, retry_s=0.0)  # every request reads the registry first
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    reference = LLM(str(folder), dtype="float32")
    expected_long = reference.generate([[5, 6, 7]], long)[0].token_ids
    expected_short = reference.generate([[8, 9]], GREEDY)[0].token_ids
    tokens: list[int] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(lambda: generate(router.address, [5, 6, 7], long))
            wait_until(lambda: decode_instance.in_flight() == 1)
            registry.answering.clear()
            waiting = pool.submit(lambda: generate(router.address, [8, 9]))
            wait_until(lambda: registry.hung == 1)
            tokens = streaming.result(timeout=60)[0]  # streams on while the other request waits
            assert not waiting.done() and registry.hung == 1
            registry.answering.set()
            assert waiting.result(timeout=60)[0] == expected_short
        assert tokens == expected_long
    finally:
        registry.answering.set()
        router.stop()
        decode_instance.stop()
