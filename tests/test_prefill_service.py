"""Prefill and decode instances over real gRPC, the caller doing the router's three calls:
Reserve on decode, Prefill (KV pushed layer by layer), Decode. Tokens equal one engine's."""

from __future__ import annotations

import grpc
import pytest
import torch

from decode_svc.server import DecodeInstance
from engine import LLM, SamplingParams
from mesh.rpc import channel
from mesh.settings import DecodeSettings, PrefillSettings
from prefill_svc.server import PrefillInstance
from protos.convert import sampling_message
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc
from tests.conftest import TINY_VOCAB
from tests.test_decode_service import collect

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def instances(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3")
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22)
    prefill = PrefillInstance(PrefillSettings(block_size=8, **common))
    decode = DecodeInstance(DecodeSettings(block_size=16, **common))
    yield (internal_pb2_grpc.PrefillStub(channel(prefill.address)),
           internal_pb2_grpc.DecodeStub(channel(decode.address)), LLM(str(folder), dtype="float32"))
    prefill.stop()
    decode.stop()


def disaggregated(prefill, decode, request_id: str, prompt: list[int], params: SamplingParams, target_override=None,
                  transport=internal_pb2.KV_TRANSPORT_GRPC_STREAM):
    sampling = sampling_message(params)
    target = decode.Reserve(internal_pb2.ReserveRequest(request_id=request_id, prompt_token_ids=prompt,
                                                        sampling=sampling, transport=transport), timeout=30).target
    if target_override is not None:
        target = target_override(target)
    done = prefill.Prefill(internal_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                                       sampling=sampling, target=target), timeout=60)
    tokens, final = collect(decode.Decode(internal_pb2.DecodeRequest(request_id=request_id,
                                                                     first_token_id=done.first_token_id,
                                                                     kv_status=done.kv_status), timeout=60))
    return done, tokens, final


@pytest.mark.parametrize("transport", [internal_pb2.KV_TRANSPORT_GRPC_STREAM, internal_pb2.KV_TRANSPORT_TORCH_P2P,
                                       internal_pb2.KV_TRANSPORT_SHARED_MEMORY])
def test_three_calls_give_exactly_the_single_engine_tokens(instances, transport):
    prefill, decode, reference = instances
    g = torch.Generator().manual_seed(21)
    for i, n in enumerate((3, 26, 61)):
        prompt = torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist()
        done, tokens, final = disaggregated(prefill, decode, f"req{i}-{transport}", prompt, GREEDY, transport=transport)
        assert done.kv_status == internal_pb2.KV_STATUS_READY and done.kv_bytes > 0
        assert tokens == reference.generate([prompt], GREEDY)[0].token_ids
        assert final.usage.completion_tokens == 8


def test_a_transfer_that_cannot_reach_decode_falls_back_to_recompute(instances):
    prefill, decode, reference = instances
    prompt = [5, 9, 13, 17, 21, 25]

    def unreachable(target):
        target.addresses[:] = ["127.0.0.1:1"]
        return target

    done, tokens, _ = disaggregated(prefill, decode, "lost", prompt, GREEDY, unreachable)
    assert done.kv_status == internal_pb2.KV_STATUS_FAILED
    assert tokens == reference.generate([prompt], GREEDY)[0].token_ids


def test_bad_prefill_requests_are_refused_with_the_reason(instances):
    prefill, _, _ = instances
    target = internal_pb2.KVTarget(transport=99)  # a transport no entry implements
    with pytest.raises(grpc.RpcError) as e:
        prefill.Prefill(internal_pb2.PrefillRequest(request_id="x", prompt_token_ids=[5], target=target), timeout=30)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "got 99" in e.value.details()
    target = internal_pb2.KVTarget(transport=internal_pb2.KV_TRANSPORT_GRPC_STREAM, addresses=["a"], block_size=16,
                                   block_table=[0], head_ranges=[internal_pb2.HeadRange(start=0, end=2)])
    with pytest.raises(grpc.RpcError) as e:
        prefill.Prefill(internal_pb2.PrefillRequest(request_id="x", prompt_token_ids=[], target=target), timeout=30)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "prompt must not be empty" in e.value.details()
