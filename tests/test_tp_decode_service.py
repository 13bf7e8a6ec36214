"""The heterogeneous layout: a context-parallel prefill instance (CP=2, block size 8) pushes KV from both of
its ranks — each the tokens it stores — to a tensor-parallel decode instance (TP=2, block size 16), each
decode rank receiving its KV heads; decoding continues exactly as one engine."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from decode_svc.server import DecodeInstance
from engine import LLM, SamplingParams
from mesh.registry import MemoryRegistry
from mesh.rpc import channel
from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc
from router.server import RouterInstance
from tests.conftest import TINY_VOCAB
from tests.test_prefill_service import disaggregated
from tests.test_router import generate

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # tiny qwen3


@pytest.fixture(scope="module")
def cp_tp_mesh(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3")  # 4 query heads, 2 KV heads: one KV head per decode rank
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22)
    prefill = PrefillInstance(PrefillSettings(block_size=8, cp=2, **common), registry=registry)
    decode = DecodeInstance(DecodeSettings(block_size=16, tp=2, **common), registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder), local_prefill_max_tokens=20), registry=registry)
    p2p = RouterSettings(model=str(folder), local_prefill_max_tokens=20, kv_transport="torch_p2p")
    p2p_router = RouterInstance(p2p, registry=registry)
    deadline = time.monotonic() + 60
    while len(registry.instances()) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield router, prefill, decode, LLM(str(folder), dtype="float32"), p2p_router
    for instance in (router, p2p_router, prefill, decode):
        instance.stop()


def test_sixteen_concurrent_requests_through_cp2_prefill_and_tp2_decode_equal_the_engine(cp_tp_mesh):
    router, prefill, decode, reference, _ = cp_tp_mesh
    assert len(prefill.core.engine.executor.ranks.processes) == 1  # CP rank 1 is a child process pushing its share
    assert len(decode.core.engine.executor.ranks.processes) == 1  # TP rank 1 is a child process with its own server
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in [5, 30, 47, 70, 12, 90, 33, 64] * 2]
    expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    before, recomputed = prefill.core.total_requests, decode.core.engine.recomputed_requests
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: generate(router.address, p), prompts))
    assert [tokens for tokens, _ in results] == expected
    assert decode.core.engine.recomputed_requests == recomputed  # every pushed KV arrived: none computed twice
    long_prompts = [tuple(p) for p in prompts if len(p) > 20]  # pushed, unless a twin's prefix is cached on decode
    assert len(set(long_prompts)) <= prefill.core.total_requests - before <= len(long_prompts)


def test_kv_over_torch_p2p_pair_groups_formed_on_demand_gives_the_engine_tokens(cp_tp_mesh):
    _, prefill, decode, reference, router = cp_tp_mesh  # this router asks decode for the torch_p2p transport
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (33, 70, 5, 48, 90, 21, 64, 40)]
    expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    before, recomputed = prefill.core.total_requests, decode.core.engine.recomputed_requests
    with ThreadPoolExecutor(8) as pool:  # the first pushes form the pair group (2 prefill + 2 decode ranks)
        results = list(pool.map(lambda p: generate(router.address, p), prompts))
    assert [tokens for tokens, _ in results] == expected
    assert decode.core.engine.recomputed_requests == recomputed  # the KV came over the pairs
    assert prefill.core.total_requests - before == sum(len(p) > 20 for p in prompts)


@pytest.mark.parametrize("transport", [internal_pb2.KV_TRANSPORT_GRPC_STREAM, internal_pb2.KV_TRANSPORT_TORCH_P2P,
                                       internal_pb2.KV_TRANSPORT_MOONCAKE])
def test_both_prefill_ranks_push_every_token_and_report_the_cp_method(cp_tp_mesh, transport):
    _, prefill_instance, decode_instance, reference, _ = cp_tp_mesh
    prefill = internal_pb2_grpc.PrefillStub(channel(prefill_instance.address))
    decode = internal_pb2_grpc.DecodeStub(channel(decode_instance.address))
    prompt = torch.randint(3, TINY_VOCAB, (61,), generator=torch.Generator().manual_seed(3 + transport)).tolist()
    first_token = []

    def record(target):
        first_token.append(target.first_token)  # decode's own cached prefix: not pushed
        return target

    for attempt in range(2):  # the second time prefill finds the prompt's full blocks cached, spread over its ranks
        done, tokens, _ = disaggregated(prefill, decode, f"whole-{attempt}-{transport}", prompt, GREEDY, record,
                                        transport)
        assert done.kv_status == internal_pb2.KV_STATUS_READY
        pushed = len(prompt) - first_token[-1]
        assert done.kv_bytes == pushed * LAYERS * KV_HEADS * HEAD_DIM * 2 * 4  # every (token, head) once, fp32
        assert done.cp_method in (internal_pb2.CP_METHOD_PASS_KV, internal_pb2.CP_METHOD_PASS_Q) and done.cp_reason
        assert tokens == reference.generate([prompt], GREEDY)[0].token_ids
    assert first_token[0] == 0 and done.cached_tokens == 56  # 7 full blocks of 8
    assert decode_instance.core.engine.recomputed_requests == 0  # the pushed KV was used, not computed again


def test_a_push_that_cannot_reach_decode_fails_on_every_rank_and_decode_recomputes(cp_tp_mesh):
    _, prefill_instance, decode_instance, reference, _ = cp_tp_mesh
    prefill = internal_pb2_grpc.PrefillStub(channel(prefill_instance.address))
    decode = internal_pb2_grpc.DecodeStub(channel(decode_instance.address))
    prompt = list(range(40, 75))

    def unreachable(target):
        target.addresses[:] = ["127.0.0.1:1", "127.0.0.1:1"]
        return target

    done, tokens, _ = disaggregated(prefill, decode, "lost", prompt, GREEDY, unreachable)
    assert done.kv_status == internal_pb2.KV_STATUS_FAILED
    assert tokens == reference.generate([prompt], GREEDY)[0].token_ids
    assert prefill_instance.core.status()["active_requests"] == 0
