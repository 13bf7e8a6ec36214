"""Load is shed, not hoarded: a flood on a one-instance mesh with a small KV cache gets RESOURCE_EXHAUSTED
at once for what does not fit (saying why) while what fits is served exactly, and nothing stays held;
a burst of requests spreads over the decode instances even before their heartbeats report the load."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from decode_svc.server import DecodeInstance
from engine import LLM, SamplingParams
from mesh import rpc
from mesh.metrics import scrape
from mesh.registry import MemoryRegistry
from mesh.settings import DecodeSettings, RouterSettings
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc
from router.server import RouterInstance
from tests.conftest import TINY_VOCAB
from tests.helpers import wait_until
from tests.test_openai_front import num_kv_blocks_hint
from tests.test_router import generate

SHORT = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)


def attempt(address: str, prompt: list[int], params: SamplingParams):
    try:
        return generate(address, prompt, params)[0]
    except grpc.RpcError as e:
        return e


def test_a_flood_on_a_small_cache_is_shed_at_once_and_what_fits_is_served(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    registry = MemoryRegistry()
    decode = DecodeInstance(DecodeSettings(model=str(folder), dtype="float32", **num_kv_blocks_hint(16)),
                            registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder)), registry=registry)
    try:
        wait_until(lambda: len(registry.instances()) == 2)
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, TINY_VOCAB, (100,), generator=g).tolist() for _ in range(12)]  # 7 blocks each
        expected = LLM(str(folder), dtype="float32").generate(prompts, SHORT)
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda p: attempt(router.address, p, SHORT), prompts))
        shed = [r for r in results if isinstance(r, grpc.RpcError)]
        assert shed and all(e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED for e in shed)
        assert all("free KV blocks, the prompt needs 7" in e.details() for e in shed)
        assert all(r == e.token_ids for r, e in zip(results, expected) if not isinstance(r, grpc.RpcError))
        admin = internal_pb2_grpc.AdminStub(rpc.channel(decode.address))
        wait_until(lambda: admin.Status(internal_pb2.StatusRequest(), timeout=10).kv_blocks_used == 0)
        outcomes = scrape(router.metrics.url)
        assert outcomes[("infermesh_requests_total", (("outcome", "resource_exhausted"),))] == len(shed)
        assert outcomes[("infermesh_requests_total", (("outcome", "ok"),))] == 12 - len(shed)
    finally:
        router.stop()
        decode.stop()


@pytest.mark.parametrize("instances", [2, 4])
def test_a_burst_spreads_evenly_before_any_heartbeat_reports_it(tiny_checkpoint, instances):
    folder, _ = tiny_checkpoint("llama")
    registry = MemoryRegistry()
    decodes = [DecodeInstance(DecodeSettings(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22,
                                             heartbeat_s=30.0, ttl_s=60.0), registry=registry)
               for _ in range(instances)]  # a heartbeat too slow to report any of the burst
    router = RouterInstance(RouterSettings(model=str(folder)), registry=registry)
    try:
        wait_until(lambda: len(registry.instances()) == instances + 1)
        with ThreadPoolExecutor(2 * instances) as pool:
            results = list(pool.map(lambda i: attempt(router.address, [5 + i, 6, 7], LONG), range(2 * instances)))
        assert all(len(r) == LONG.max_tokens for r in results)
        assert sorted(d.core.total_requests for d in decodes) == [2] * instances  # 6 vs 0 before
    finally:
        router.stop()
        for d in decodes:
            d.stop()
