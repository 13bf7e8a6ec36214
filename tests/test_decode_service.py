"""A decode instance over real gRPC: KV pushed from a prefill engine into its reservations, tokens streamed,
cancellation frees blocks, bad input gets the right status code, and it keeps serving."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from decode_svc.server import DecodeInstance
from engine import LLM, SamplingParams
from engine.core import EngineConfig, EngineCore
from engine.weights import load_checkpoint
from kvtransfer.grpc_stream import GrpcStreamSender
from kvtransfer.plan import DecodeLayout
from kvtransfer.sink import PlanSink
from mesh.rpc import channel
from mesh.settings import DecodeSettings
from protos.convert import sampling_message
from protos.infermesh.v1 import common_pb2, internal_pb2, internal_pb2_grpc
from tests.conftest import TINY_VOCAB

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def decode(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    instance = DecodeInstance(DecodeSettings(model=str(folder), dtype="float32", block_size=16,
                                             kv_cache_bytes=64 * 2 * 2 * 16 * 2 * 16 * 4))  # 64 blocks
    ch = channel(instance.address)
    yield instance, internal_pb2_grpc.DecodeStub(ch), internal_pb2_grpc.AdminStub(ch), str(folder)
    ch.close()
    instance.stop()
    instance.stop()  # safe twice


def collect(responses) -> tuple[list[int], object]:
    tokens, final = [], None
    for r in responses:
        if r.HasField("delta"):
            tokens += r.delta.token_ids
        else:
            final = r.final
    return tokens, final


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_kv_pushed_into_a_reservation_continues_exactly_as_one_engine(decode):
    instance, stub, admin, folder = decode
    p = prompt(29)
    (expected,) = LLM(folder, dtype="float32").generate([p], GREEDY)
    target = stub.Reserve(internal_pb2.ReserveRequest(request_id="r1", prompt_token_ids=p,
                                                      sampling=sampling_message(GREEDY)), timeout=30).target
    assert target.addresses == [instance.endpoints["grpc_stream"].address] and target.block_size == 16
    prefill = EngineCore(load_checkpoint(folder), EngineConfig(dtype="float32", block_size=8, num_kv_blocks=32))
    layout = DecodeLayout(head_ranges=tuple((h.start, h.end) for h in target.head_ranges), block_size=target.block_size,
                          block_table=tuple(target.block_table), first_token=target.first_token)
    sink = PlanSink(num_tokens=len(p), num_kv_heads=2, block_size=8, num_layers=len(prefill.kv_cache), target=layout,
                    senders=[GrpcStreamSender(channel(a), "r1", i) for i, a in enumerate(target.addresses)])
    prefill.add_request("r1", p, SamplingParams(max_tokens=1, temperature=0.0), kv_sink=sink)
    first = next(out for out in iter(prefill.step, None) if out)[0].new_token_ids[0]
    sink.finish()
    tokens, final = collect(stub.Decode(internal_pb2.DecodeRequest(request_id="r1", first_token_id=first,
                                                                   kv_status=internal_pb2.KV_STATUS_READY), timeout=60))
    assert tokens == expected.token_ids
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (29, 8)


def test_prefill_locally_and_recompute_after_a_failed_transfer_give_the_same_tokens(decode):
    _, stub, _, folder = decode
    p = prompt(12, seed=1)
    (expected,) = LLM(folder, dtype="float32").generate([p], GREEDY)
    local, _ = collect(stub.Decode(internal_pb2.DecodeRequest(request_id="local", prefill_locally=True,
                                                              prompt_token_ids=p, sampling=sampling_message(GREEDY)),
                                   timeout=60))
    stub.Reserve(internal_pb2.ReserveRequest(request_id="lost", prompt_token_ids=p, sampling=sampling_message(GREEDY)))
    lost = internal_pb2.DecodeRequest(request_id="lost", kv_status=internal_pb2.KV_STATUS_FAILED)
    recomputed, _ = collect(stub.Decode(lost, timeout=60))
    assert local == recomputed == expected.token_ids


def blocks_used(admin) -> int:
    return admin.Status(internal_pb2.StatusRequest(), timeout=10).kv_blocks_used


def test_cancelling_a_stream_frees_its_blocks(decode):
    _, stub, admin, _ = decode
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    call = stub.Decode(internal_pb2.DecodeRequest(request_id="cancel-me", prefill_locally=True,
                                                  prompt_token_ids=prompt(40, seed=2), sampling=sampling_message(long)))
    first = next(call)
    assert first.delta.token_ids  # tokens arrive before the request is done
    assert blocks_used(admin) > 0
    call.cancel()
    deadline = time.monotonic() + 30
    while blocks_used(admin) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert blocks_used(admin) == 0


def test_bad_requests_get_clear_status_codes_and_the_service_keeps_serving(decode):
    _, stub, admin, folder = decode
    bad = common_pb2.SamplingParams(temperature=-1)
    with pytest.raises(grpc.RpcError) as e:
        collect(stub.Decode(internal_pb2.DecodeRequest(request_id="b1", prefill_locally=True, prompt_token_ids=[5],
                                                       sampling=bad), timeout=30))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "temperature must be >= 0" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Reserve(internal_pb2.ReserveRequest(request_id="b2", prompt_token_ids=[TINY_VOCAB + 5]), timeout=30)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "out of range [0, 320)" in e.value.details()
    for holder in ("h1", "h2"):  # 2 x 32 blocks: the cache is full
        held = prompt(500, seed=len(holder) + ord(holder[1]))
        stub.Reserve(internal_pb2.ReserveRequest(request_id=holder, prompt_token_ids=held))
    with pytest.raises(grpc.RpcError) as e:
        stub.Reserve(internal_pb2.ReserveRequest(request_id="b3", prompt_token_ids=[5] * 100), timeout=30)
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "free blocks" in e.value.details()
    assert all(stub.Cancel(internal_pb2.CancelRequest(request_id=h)).found for h in ("h1", "h2"))
    with pytest.raises(grpc.RpcError) as e:
        collect(stub.Decode(internal_pb2.DecodeRequest(request_id="nobody", kv_status=internal_pb2.KV_STATUS_READY),
                            timeout=30))
    assert e.value.code() is grpc.StatusCode.NOT_FOUND
    assert blocks_used(admin) == 0
    after = internal_pb2.DecodeRequest(request_id="after", prefill_locally=True, prompt_token_ids=[5, 6],
                                       sampling=sampling_message(GREEDY))
    tokens, _ = collect(stub.Decode(after, timeout=60))
    assert len(tokens) == 8
