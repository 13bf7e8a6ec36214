"""The lifecycle every service shares (mesh.instance), passed by each of them over real gRPC: started, it
says SERVING to health checks and the registry; `Admin.Drain` makes it say NOT_SERVING at once and refuse
new work with UNAVAILABLE while the work it already holds runs to its end; then it deregisters and stops
by itself, and `stop()` is safe again. An engine failure makes an instance report DRAINING everywhere."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_svc.server import DecodeInstance
from engine import SamplingParams
from expert_svc.server import ExpertInstance
from mesh.registry import InstanceState, MemoryRegistry
from mesh.rpc import LIVENESS, channel
from mesh.settings import DecodeSettings, ExpertSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from protos.convert import sampling_message
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from router.server import RouterInstance
from tests.helpers import wait_until
from tests.test_decode_service import collect

LONG = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
UNREACHABLE_TARGET = internal_pb2.KVTarget(  # a decode "instance" nobody serves: prefill still answers, KV failed
    transport=internal_pb2.KV_TRANSPORT_GRPC_STREAM, addresses=["127.0.0.1:1"], block_size=16, block_table=[0],
    head_ranges=[internal_pb2.HeadRange(start=0, end=2)], dtype=internal_pb2.DTYPE_FLOAT32)


def health(address: str, service: str = ""):
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def hold_steps(instance):
    """Make the instance's engine wait before each step until the returned event is set: its work stays in flight."""
    engine, gate = instance.core.engine, threading.Event()
    step = engine.step
    engine.step = lambda: gate.wait(60) and step()
    return gate


def drain(address: str) -> internal_pb2.InstanceStatus:
    status = internal_pb2_grpc.AdminStub(channel(address)).Drain(internal_pb2.DrainRequest(timeout_s=60), timeout=10)
    assert status.state == common_pb2.INSTANCE_STATE_DRAINING
    assert health(address) == NOT_SERVING and health(address, LIVENESS) == SERVING  # not ready, but alive
    return status


def refused(call) -> None:
    """`call()` fails with UNAVAILABLE, saying the instance takes no new work (a stream: on its first read)."""
    with pytest.raises(grpc.RpcError) as e:
        result = call()
        if hasattr(result, "__next__"):
            next(result)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "takes no new work" in e.value.details()


def assert_stopped(instance, registry: MemoryRegistry) -> None:
    assert instance.wait(60), "the drained instance did not stop"
    assert instance.state is InstanceState.STOPPED and instance.id not in [i.id for i in registry.instances()]
    with pytest.raises(grpc.RpcError) as e:
        health(instance.address)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE  # the server is gone
    instance.stop()  # safe twice


def serving(instance, registry: MemoryRegistry) -> None:
    assert instance.state is InstanceState.SERVING and health(instance.address) == SERVING
    wait_until(lambda: [i.state for i in registry.instances() if i.id == instance.id] == [InstanceState.SERVING])


@pytest.fixture
def llama(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    return dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22)


def test_decode_finishes_streams_and_reservations_it_holds_refuses_new_ones_and_stops(llama):
    registry = MemoryRegistry()
    decode = DecodeInstance(DecodeSettings(**llama), registry=registry)
    serving(decode, registry)
    stub = internal_pb2_grpc.DecodeStub(channel(decode.address))
    stub.Reserve(internal_pb2.ReserveRequest(request_id="reserved", prompt_token_ids=[7, 8, 9],
                                             sampling=sampling_message(LONG)), timeout=10)
    gate = hold_steps(decode)
    stream = stub.Decode(internal_pb2.DecodeRequest(request_id="running", prefill_locally=True, prompt_token_ids=[5, 6],
                                                    sampling=sampling_message(LONG)), timeout=60)
    wait_until(lambda: decode.in_flight() == 2)
    drain(decode.address)
    refused(lambda: stub.Reserve(internal_pb2.ReserveRequest(request_id="new", prompt_token_ids=[5]), timeout=10))
    refused(lambda: stub.Decode(internal_pb2.DecodeRequest(request_id="new", prefill_locally=True, prompt_token_ids=[5],
                                                           sampling=sampling_message(LONG)), timeout=10))
    gate.set()
    joined = stub.Decode(internal_pb2.DecodeRequest(request_id="reserved", kv_status=internal_pb2.KV_STATUS_FAILED),
                         timeout=60)  # the reservation's join is in-flight work: admitted while draining
    for call in (stream, joined):
        tokens, final = collect(call)
        assert len(tokens) == 12 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_stopped(decode, registry)


def test_prefill_finishes_the_prompt_it_holds_refuses_new_ones_and_stops(llama):
    registry = MemoryRegistry()
    prefill = PrefillInstance(PrefillSettings(**llama), registry=registry)
    serving(prefill, registry)
    stub = internal_pb2_grpc.PrefillStub(channel(prefill.address))
    target = UNREACHABLE_TARGET
    request = internal_pb2.PrefillRequest(request_id="held", prompt_token_ids=[5, 6, 7], target=target,
                                          sampling=sampling_message(LONG))
    gate = hold_steps(prefill)
    held = stub.Prefill.future(request, timeout=60)
    wait_until(lambda: prefill.in_flight() == 1)
    drain(prefill.address)
    refused(lambda: stub.Prefill(internal_pb2.PrefillRequest(request_id="new", prompt_token_ids=[5], target=target),
                                 timeout=10))
    gate.set()
    done = held.result()  # the prompt ran to its first token; its KV had nowhere to go (decode recomputes)
    assert done.kv_status == internal_pb2.KV_STATUS_FAILED and 0 <= done.first_token_id < 320
    assert_stopped(prefill, registry)


def test_router_finishes_the_streams_it_serves_refuses_new_ones_and_stops(llama):
    registry = MemoryRegistry()
    decode = DecodeInstance(DecodeSettings(**llama), registry=registry)
    router = RouterInstance(RouterSettings(model=llama["model"]), registry=registry)
    try:
        serving(router, registry)
        stub = inference_pb2_grpc.InferenceStub(channel(router.address))
        request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[5, 6, 7]),
                                                sampling=sampling_message(LONG))
        gate = hold_steps(decode)
        stream = stub.Generate(request, timeout=60)
        wait_until(lambda: router.in_flight() == 1)
        drain(router.address)
        refused(lambda: stub.Generate(request, timeout=10))
        gate.set()
        tokens, final = collect(stream)
        assert len(tokens) == 12 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert_stopped(router, registry)
        assert f"{router.id}-loop" not in {t.name for t in threading.enumerate()}  # its event loop's thread ended
    finally:
        decode.stop()


def test_expert_serves_its_attachments_until_they_leave_refuses_new_ones_and_stops(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    registry = MemoryRegistry()
    experts = ExpertInstance(ExpertSettings(model=str(folder), dtype="float32"), registry=registry)
    serving(experts, registry)
    attached = subprocess.Popen([sys.executable, "-m", "decode_svc.server", "--model", str(folder),
                                 "--dtype", "float32", "--experts", experts.address],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = next(line.split()[-1] for line in attached.stdout if " serving on " in line)
        wait_until(lambda: experts.in_flight() == 1)
        drain(experts.address)
        refused(lambda: internal_pb2_grpc.ExpertStub(channel(experts.address)).Attach(
            internal_pb2.AttachRequest(instance_id="late", ranks=1, model=str(folder)), timeout=10))
        tokens, final = collect(internal_pb2_grpc.DecodeStub(channel(address)).Decode(internal_pb2.DecodeRequest(
            request_id="through-experts", prefill_locally=True, prompt_token_ids=[5, 6, 7],
            sampling=sampling_message(LONG)), timeout=60))  # the attachment still serves its MoE layers
        assert len(tokens) == 12
        assert experts.state is InstanceState.DRAINING
    finally:
        attached.terminate()  # the attached instance leaves: the drain's in-flight work is over
        attached.wait(timeout=30)
    assert_stopped(experts, registry)


def test_an_engine_failure_makes_prefill_report_draining_to_health_admin_and_registry(llama):
    registry = MemoryRegistry()
    prefill = PrefillInstance(PrefillSettings(**llama), registry=registry)
    try:
        serving(prefill, registry)

        def broken_step():
            raise RuntimeError("device lost")

        prefill.core.engine.step = broken_step
        with pytest.raises(grpc.RpcError) as e:
            internal_pb2_grpc.PrefillStub(channel(prefill.address)).Prefill(internal_pb2.PrefillRequest(
                request_id="r", prompt_token_ids=[5, 6], target=UNREACHABLE_TARGET), timeout=30)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "device lost" in e.value.details()
        status = internal_pb2_grpc.AdminStub(channel(prefill.address)).Status(internal_pb2.StatusRequest(), timeout=10)
        assert status.state == common_pb2.INSTANCE_STATE_DRAINING and health(prefill.address) == NOT_SERVING
        assert health(prefill.address, LIVENESS) == NOT_SERVING  # a liveness probe restarts it
        wait_until(lambda: [i.state for i in registry.instances() if i.id == prefill.id] == [InstanceState.DRAINING])
    finally:
        prefill.stop()
