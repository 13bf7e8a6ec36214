"""A decode instance of two tensor-parallel ranks takes KV pushed by a prefill instance on both ranks (each
rank its KV heads, one head replicated when heads do not split evenly) and continues exactly."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from decode_svc.server import DecodeInstance
from engine import LLM, SamplingParams
from mesh.registry import MemoryRegistry
from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from router.server import RouterInstance
from tests.conftest import TINY_VOCAB
from tests.test_router import generate

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_mesh(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3")  # 4 query heads, 2 KV heads: one KV head per decode rank
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22)
    prefill = PrefillInstance(PrefillSettings(block_size=8, **common), registry=registry)
    decode = DecodeInstance(DecodeSettings(block_size=16, tp=2, **common), registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder), local_prefill_max_tokens=20), registry=registry)
    deadline = time.monotonic() + 60
    while len(registry.instances()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield router, prefill, decode, LLM(str(folder), dtype="float32")
    for instance in (router, prefill, decode):
        instance.stop()


def test_pushed_kv_reaches_every_decode_rank_and_tokens_equal_the_engine(tp_mesh):
    router, prefill, decode, reference = tp_mesh
    assert len(decode.core.engine.executor.ranks.processes) == 1  # rank 1 is a child process with its own server
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 30, 47, 70, 12, 90, 33, 64)]
    expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    before = prefill.core.total_requests
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: generate(router.address, p), prompts))
    assert [tokens for tokens, _ in results] == expected
    assert prefill.core.total_requests - before == sum(len(p) > 20 for p in prompts)  # those went through the push
