"""How many streams a mesh runs at once, over real gRPC: a stream holds a server thread on the router and on
decode for its whole life, so every stream a client opens must get one — 40 concurrent streams all join
decode's running batch together (the thread pools once held 16, and the rest queued unseen) and each equals
the engine's own greedy tokens; past `max_concurrent_rpcs` a stream is refused with RESOURCE_EXHAUSTED at
once rather than queued, and the streams already running finish."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from decode_svc.server import DecodeInstance
from engine import LLM, SamplingParams
from mesh.registry import MemoryRegistry, Role
from mesh.settings import DecodeSettings, RouterSettings
from router.server import RouterInstance
from tests.conftest import TINY_VOCAB
from tests.helpers import wait_until
from tests.test_router import generate

STREAMS = 40
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def steps_once(decode: DecodeInstance, running: int, release: threading.Event) -> None:
    """Decode's engine takes no step until `running` requests are in flight (or `release` is set)."""
    engine = decode.core.engine
    step = engine.step

    def gated():
        if decode.core.in_flight >= running or release.is_set():
            return step()
        time.sleep(0.001)  # back to the loop, which takes the next request in
        return []

    engine.step = gated


@pytest.fixture
def mesh(tiny_checkpoint, request):
    folder, _ = tiny_checkpoint("llama")
    registry = MemoryRegistry()
    limit = getattr(request, "param", 512)
    decode = DecodeInstance(DecodeSettings(model=str(folder), dtype="float32", block_size=16,
                                           kv_cache_bytes=1 << 24), registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder), max_concurrent_rpcs=limit), registry=registry)
    wait_until(lambda: registry.instances(Role.DECODE))
    release = threading.Event()
    yield router, decode, release, str(folder)
    release.set()
    router.stop()
    decode.stop()


def test_every_stream_a_client_opens_runs_at_once(mesh):
    router, decode, release, folder = mesh
    steps_once(decode, STREAMS, release)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in range(4, 4 + STREAMS)]
    with ThreadPoolExecutor(STREAMS) as pool:
        streams = [pool.submit(generate, router.address, p, GREEDY) for p in prompts]
        wait_until(lambda: decode.core.in_flight == STREAMS, timeout_s=60)  # all in decode's batch together
        results = [s.result(timeout=120) for s in streams]
    reference = LLM(folder, dtype="float32").generate(prompts, GREEDY)
    assert [tokens for tokens, _ in results] == [r.token_ids for r in reference]
    assert decode.core.engine.blocks.num_used_blocks == 0 and decode.core.in_flight == 0


@pytest.mark.parametrize("mesh", [3], indirect=True)
def test_a_stream_past_the_limit_is_refused_at_once_and_the_others_finish(mesh):
    router, decode, release, _ = mesh
    steps_once(decode, STREAMS, release)  # no step until released: three streams fill the router's three slots
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(generate, router.address, [5, 6, 7, i], GREEDY) for i in range(3)]
        wait_until(lambda: decode.core.in_flight == 3, timeout_s=60)
        with pytest.raises(grpc.RpcError) as refused:
            generate(router.address, [5, 6, 7, 8], GREEDY)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        assert all(len(h.result(timeout=60)[0]) == GREEDY.max_tokens for h in held)
    assert decode.core.engine.blocks.num_used_blocks == 0
