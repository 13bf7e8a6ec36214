"""A decode instance over real gRPC: KV pushed from a prefill engine into its reservations, tokens streamed,
cancellation frees blocks, bad input gets the right status code, and it keeps serving."""

from __future__ import annotations

import asyncio
import threading
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
from mesh.rpc import ChannelPool, aio_channel, channel
from mesh.settings import DecodeSettings
from protos.convert import sampling_message
from protos.infermesh.v1 import common_pb2, internal_pb2, internal_pb2_grpc
from router.decode_streams import DecodeStreams
from tests.conftest import TINY_VOCAB
from tests.helpers import kv_blocks_used, wait_until

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



def test_cancelling_a_stream_frees_its_blocks(decode):
    _, stub, admin, _ = decode
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    call = stub.Decode(internal_pb2.DecodeRequest(request_id="cancel-me", prefill_locally=True,
                                                  prompt_token_ids=prompt(40, seed=2), sampling=sampling_message(long)))
    first = next(call)
    assert first.delta.token_ids  # tokens arrive before the request is done
    assert kv_blocks_used(admin) > 0
    call.cancel()
    deadline = time.monotonic() + 30
    while kv_blocks_used(admin) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_blocks_used(admin) == 0


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
    assert kv_blocks_used(admin) == 0
    after = internal_pb2.DecodeRequest(request_id="after", prefill_locally=True, prompt_token_ids=[5, 6],
                                       sampling=sampling_message(GREEDY))
    tokens, _ = collect(stub.Decode(after, timeout=60))
    assert len(tokens) == 8


# ---- many requests on one stream (the router's way: router.decode_streams) ------------------------------

def local(rid: str, p: list[int], params: SamplingParams = GREEDY) -> internal_pb2.DecodeRequest:
    return internal_pb2.DecodeRequest(request_id=rid, prefill_locally=True, prompt_token_ids=p,
                                      sampling=sampling_message(params))


async def acollect(responses) -> tuple[list[int], object]:
    tokens, final = [], None
    async for r in responses:
        if r.HasField("delta"):
            tokens += r.delta.token_ids
        else:
            final = r.final
    return tokens, final


async def closed(streams: DecodeStreams, channels: ChannelPool) -> None:
    """Close the router's streams and channels, then check nothing of them runs on the loop any more."""
    streams.close()
    await channels.aclose()
    await asyncio.sleep(0.1)
    assert asyncio.all_tasks() == {asyncio.current_task()}


def test_requests_on_one_stream_get_their_own_tokens_and_share_its_messages(decode):
    """Six requests at once on the router's stream get each the tokens an engine gives it alone; on a raw
    stream, one message carries the tokens of several requests (one engine step's)."""
    instance, stub, admin, folder = decode
    prompts = {f"s{i}": prompt(5 + 7 * i, seed=10 + i) for i in range(6)}
    expected = dict(zip(prompts, (o.token_ids for o in LLM(folder, dtype="float32").generate(
        list(prompts.values()), GREEDY))))

    async def router():
        channels = ChannelPool(aio_channel)
        streams = DecodeStreams(channels)
        got = await asyncio.gather(*(acollect(streams.decode(instance.address, local(rid, p), timeout=60))
                                     for rid, p in prompts.items()))
        await closed(streams, channels)
        return dict(zip(prompts, got))

    got = asyncio.run(router())
    assert {rid: tokens for rid, (tokens, _) in got.items()} == expected
    assert all(final.finish_reason == common_pb2.FINISH_REASON_LENGTH for _, final in got.values())

    done = threading.Event()

    def requests():  # four requests, then the stream stays open until they finished (closing it cancels)
        yield from (internal_pb2.StreamRequest(decode=local(f"raw{i}", prompts[f"s{i}"])) for i in range(4))
        done.wait(60)

    finals, per_message = set(), []
    for message in stub.Stream(requests(), timeout=60):
        per_message.append({e.request_id for e in message.events})
        finals |= {e.request_id for e in message.events if e.response.HasField("final")}
        if len(finals) == 4:
            done.set()
    assert finals == {f"raw{i}" for i in range(4)} and max(len(ids) for ids in per_message) >= 2
    wait_until(lambda: kv_blocks_used(admin) == 0)


def test_a_request_that_fails_on_a_stream_fails_alone_with_its_status_code(decode):
    """Bad sampling parameters and a join without a reservation end those requests with the codes a Decode
    call gets (INVALID_ARGUMENT naming the field, NOT_FOUND); a request beside them streams on."""
    instance, _, admin, folder = decode
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def router():
        channels = ChannelPool(aio_channel)
        streams = DecodeStreams(channels)
        good = streams.decode(instance.address, local("good", prompt(9, seed=3), long), timeout=60)
        first = await anext(good)
        bad_sampling = internal_pb2.DecodeRequest(request_id="bad", prefill_locally=True, prompt_token_ids=[5],
                                                  sampling=common_pb2.SamplingParams(temperature=-1))
        with pytest.raises(grpc.RpcError) as e:
            await acollect(streams.decode(instance.address, bad_sampling, timeout=60))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "temperature must be >= 0" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            await acollect(streams.decode(instance.address, internal_pb2.DecodeRequest(
                request_id="nobody", kv_status=internal_pb2.KV_STATUS_READY), timeout=60))
        assert e.value.code() is grpc.StatusCode.NOT_FOUND and "nobody" in e.value.details()
        tokens, _ = await acollect(good)
        await closed(streams, channels)
        return list(first.delta.token_ids) + tokens

    got = asyncio.run(router())
    (expected,) = LLM(folder, dtype="float32").generate([prompt(9, seed=3)], long)
    assert got == expected.token_ids
    wait_until(lambda: kv_blocks_used(admin) == 0)


def test_a_request_cancelled_timed_out_or_left_on_a_closed_stream_is_aborted_and_frees_its_blocks(decode, monkeypatch):
    """Its task cancelled (the router's client left), past its deadline, closed unread, or open when the
    router closes the stream: decode aborts the request (it does not run on to its end) and frees its blocks
    each time; the stream serves on but for the last."""
    instance, _, admin, _ = decode
    engine, aborted = instance.core.engine, []
    abort = engine.abort
    monkeypatch.setattr(engine, "abort", lambda rid: aborted.append(rid) or abort(rid))
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def eventually(condition) -> None:
        await asyncio.to_thread(wait_until, condition)

    async def router():
        channels = ChannelPool(aio_channel)
        streams = DecodeStreams(channels)
        first = asyncio.Event()

        async def client():
            async for _ in streams.decode(instance.address, local("c1", prompt(40, seed=4), long), timeout=60):
                first.set()

        task = asyncio.create_task(client())
        await first.wait()
        assert kv_blocks_used(admin) > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(lambda: kv_blocks_used(admin) == 0)

        late = streams.decode(instance.address, local("c2", prompt(40, seed=5), long), timeout=0.05)
        with pytest.raises(grpc.RpcError) as e:
            await acollect(late)
        assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: kv_blocks_used(admin) == 0)

        tokens, _ = await acollect(streams.decode(instance.address, local("c3", [5, 6]), timeout=60))
        assert len(tokens) == 8  # the same stream serves on
        unread = streams.decode(instance.address, local("c5", prompt(40, seed=7), long), timeout=60)
        await eventually(lambda: kv_blocks_used(admin) > 0)
        unread.close()
        await eventually(lambda: kv_blocks_used(admin) == 0)
        left = streams.decode(instance.address, local("c4", prompt(40, seed=6), long), timeout=60)
        assert (await anext(left)).delta.token_ids and kv_blocks_used(admin) > 0
        streams.close()
        with pytest.raises(grpc.RpcError) as e:
            await acollect(left)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        await eventually(lambda: kv_blocks_used(admin) == 0)
        await closed(streams, channels)

    asyncio.run(router())
    assert {"c1", "c2", "c4", "c5"} <= set(aborted) and "c3" not in aborted
