"""Expert instances over real gRPC and real process groups: an expert instance of two EP ranks serves both a
prefill instance (CP=2) and a decode instance (TP=2) attached to it; greedy tokens through the router equal
transformers'; status shows placement, tokens per expert and the attached instances; bad attaches are refused;
when the expert instance dies, its attached decode instance fails at once and the router serves the request
elsewhere; when it hangs (SIGSTOP) or dies mid-stream, the attached instances fail within expert_timeout_s
and the stream migrates. Every real service (router, prefill, decode, expert) answers grpc.health.v1 and
server reflection."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from decode_svc.server import DecodeInstance
from engine import LLM, SamplingParams
from expert_svc.server import ExpertInstance
from mesh.registry import InstanceState, MemoryRegistry
from mesh.rpc import LIVENESS, channel
from mesh.settings import DecodeSettings, ExpertSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from protos.convert import sampling_message
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from router.server import RouterInstance
from tests.conftest import TINY_VOCAB
from tests.helpers import assert_exited, descendants, wait_until
from tests.test_lifecycle import health
from tests.test_metrics import scrape, value
from tests.test_parity_tiny import hf_greedy
from tests.test_router import generate
from tests.test_rpc_and_tracing import by_reflection

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all

EXPERT_TIMEOUT_S = 5.0


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def expert_mesh(request, tiny_checkpoint, tmp_path_factory):
    folder, hf = tiny_checkpoint(request.param)
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32")
    metrics = tmp_path_factory.mktemp("metrics") / "metrics.jsonl"
    experts = ExpertInstance(ExpertSettings(ep=2, metrics=f"file:{metrics}", **common), registry=registry)
    engine = dict(kv_cache_bytes=1 << 22, experts=experts.address, **common)
    prefill = PrefillInstance(PrefillSettings(block_size=8, cp=2, **engine), registry=registry)
    decode = DecodeInstance(DecodeSettings(block_size=16, tp=2, **engine), registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder), local_prefill_max_tokens=20), registry=registry)
    deadline = time.monotonic() + 60
    while len(registry.instances()) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield router, prefill, decode, experts, hf
    for instance in (router, prefill, decode, experts):
        instance.stop()


def test_eight_concurrent_requests_through_attached_experts_equal_transformers(expert_mesh):
    router, prefill, decode, experts, hf = expert_mesh
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (1, 30, 12, 47, 5, 64, 25, 9)]
    with ThreadPoolExecutor(8) as pool:  # long prompts prefill on the CP instance, short ones on decode
        results = list(pool.map(lambda p: generate(router.address, p), prompts))
    assert [tokens for tokens, _ in results] == [hf_greedy(hf, p, 6)[0] for p in prompts]
    admin = internal_pb2_grpc.AdminStub(channel(experts.address))
    # the second EP rank (a child process) publishes its counts every 0.5 s: wait until they arrived and
    # settled (two readings 0.6 s apart agree), so the metrics below read the same final counts
    deadline, previous = time.monotonic() + 10, None
    while True:
        status = admin.Status(internal_pb2.StatusRequest(), timeout=30)
        tokens = torch.tensor([list(layer.tokens) for layer in status.expert_load])  # [MoE layers, experts]
        settled = previous is not None and torch.equal(tokens, previous)
        if (tokens[:, 2:].sum() > 0 and settled) or time.monotonic() > deadline:
            break
        previous = tokens
        time.sleep(0.6)
    assert status.role == common_pb2.ROLE_EXPERT and list(status.placement) == [0, 0, 1, 1]
    assert sorted(status.attached) == sorted([prefill.id, decode.id])
    (record,) = [i for i in router.registry.instances() if i.id == experts.id]  # registered with its placement
    assert record.placement == (0, 0, 1, 1) and record.rendezvous == experts.book.address
    assert tokens.shape == (2, 4) and (tokens.sum(1) > 0).all()
    assert tokens[:, 2:].sum() > 0  # the second EP rank's counts reached rank 0's status
    experts.metrics.provider.force_flush()  # the same counts as OpenTelemetry metrics
    exported = {}
    for line in Path(experts.settings.metrics[5:]).read_text().splitlines():
        point = json.loads(line)
        if point["name"] == "infermesh_expert_tokens":
            exported[point["attributes"]["layer"], point["attributes"]["expert"]] = point["value"]  # the latest
    assert exported == {(layer, e): int(tokens[layer, e]) for layer in range(2) for e in range(4)}
    scraped = scrape(experts.metrics.url)  # and on its Prometheus endpoint
    assert {(layer, e): value(scraped, "infermesh_expert_tokens_total", layer=str(layer), expert=str(e))
            for layer in range(2) for e in range(4)} == exported


def test_every_real_service_answers_health_and_reflection(expert_mesh):
    """A client that knows none of our stubs finds each instance's service and Admin by reflection, calls
    Admin.Status with what reflection describes, and reads SERVING from grpc.health.v1."""
    router, prefill, decode, experts, _ = expert_mesh
    serving = health_pb2.HealthCheckResponse.SERVING
    for instance, service in ((router, "Inference"), (prefill, "Prefill"), (decode, "Decode"), (experts, "Expert")):
        services, status = by_reflection(instance.address, "infermesh.v1.Admin", "Status")
        assert {f"infermesh.v1.{service}", "infermesh.v1.Admin", "grpc.health.v1.Health"} <= services
        assert status.id == instance.id
        for name in ("", f"infermesh.v1.{service}", "infermesh.v1.Admin", LIVENESS):
            assert health(instance.address, name) == serving, (instance.id, name)


def test_attach_refuses_another_model_and_zero_ranks_and_detach_forgets(expert_mesh):
    _, _, decode, experts, _ = expert_mesh
    stub = internal_pb2_grpc.ExpertStub(channel(experts.address))
    with pytest.raises(grpc.RpcError) as e:
        stub.Attach(internal_pb2.AttachRequest(instance_id="x", ranks=1, model="other"), timeout=10)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "'other'" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Attach(internal_pb2.AttachRequest(instance_id="x", ranks=0, model=experts.settings.model), timeout=10)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "ranks must be >= 1" in e.value.details()
    assert stub.Detach(internal_pb2.DetachRequest(instance_id=decode.id)).found
    assert decode.id not in experts.attached()
    assert not stub.Detach(internal_pb2.DetachRequest(instance_id=decode.id)).found


def start_expert_process(folder, ep: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "expert_svc.server", "--model", str(folder), "--ep", str(ep),
                             "--dtype", "float32"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if " serving on " in line:
            return proc, line.split()[-1]
    raise AssertionError(f"the expert instance did not start (exit {proc.wait(timeout=30)})")


def test_a_dead_expert_instance_fails_its_attached_decode_and_the_router_retries_elsewhere(tiny_checkpoint):
    folder, hf = tiny_checkpoint("mixtral")
    proc, address = start_expert_process(folder, ep=2)
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22)
    attached = DecodeInstance(DecodeSettings(experts=address, expert_timeout_s=10, **common), registry=registry)
    standalone = DecodeInstance(DecodeSettings(**common), registry=registry)  # runs its experts itself
    router = RouterInstance(RouterSettings(model=str(folder), policy="round_robin"), registry=registry)
    try:
        prompt = [5, 9, 13, 17]
        assert generate(router.address, prompt)[0] == hf_greedy(hf, prompt, 6)[0]
        proc.kill()  # its second EP rank dies with it
        proc.wait(timeout=30)
        for _ in range(4):  # round robin: some of these go to the attached instance first, fail, and are retried
            assert generate(router.address, prompt)[0] == hf_greedy(hf, prompt, 6)[0]
        assert attached.core.failed and not standalone.core.failed
        def state():
            return {i.id: i.state for i in registry.instances()}[attached.id]

        deadline = time.monotonic() + 10  # the next heartbeat tells the registry
        while state() is not InstanceState.DRAINING and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state() is InstanceState.DRAINING
    finally:
        for instance in (router, attached, standalone):
            instance.stop()
        proc.kill()


def test_upcycled_smollm2_through_an_expert_instance_gives_the_dense_model_tokens():
    from engine import LLM, SamplingParams

    registry = MemoryRegistry()
    common = dict(model="smollm2-135m-moe", dtype="float32")
    experts = ExpertInstance(ExpertSettings(ep=2, **common), registry=registry)
    decode = DecodeInstance(DecodeSettings(experts=experts.address, kv_cache_bytes=1 << 24, **common),
                            registry=registry)
    router = RouterInstance(RouterSettings(model="smollm2-135m-moe"), registry=registry)
    try:
        with LLM("smollm2-135m", dtype="float32") as dense:
            prompt = dense.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
            expected = dense.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0].token_ids
        tokens, _ = generate(router.address, prompt, SamplingParams(max_tokens=10, temperature=0.0))
        assert tokens == expected
        status = internal_pb2_grpc.AdminStub(channel(experts.address)).Status(internal_pb2.StatusRequest(), timeout=30)
        assert len(status.expert_load) == 30 and all(sum(layer.tokens) > 0 for layer in status.expert_load)
    finally:
        for instance in (router, decode, experts):
            instance.stop()


def first_delta_then_rest(address: str, prompt: list[int], params: SamplingParams):
    """A started stream: (an event set at its first delta, a future of all its token ids)."""
    arrived, pool = threading.Event(), ThreadPoolExecutor(1)

    def read() -> list[int]:
        tokens = []
        for r in inference_pb2_grpc.InferenceStub(channel(address)).Generate(inference_pb2.GenerateRequest(
                token_ids=inference_pb2.TokenIds(ids=prompt), sampling=sampling_message(params)), timeout=120):
            tokens += r.delta.token_ids
            arrived.set()
        return tokens

    future = pool.submit(read)
    pool.shutdown(wait=False)
    return arrived, future


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["hangs", "dies"])
def test_an_expert_instance_that_hangs_or_dies_mid_step_fails_its_attached_instances_in_time(tiny_checkpoint,
                                                                                             fault):
    """Mid-stream, the expert instance is stopped (a hung peer) or killed: the attached decode instance's step
    fails within expert_timeout_s and the router migrates the stream to a decode instance that runs its own
    experts; the attached prefill instance's next step fails the same way and decode recomputes the prompt.
    Every client gets the engine's tokens; no process is left behind."""
    folder, hf = tiny_checkpoint("mixtral")
    before = set(descendants(os.getpid()))
    proc, address = start_expert_process(folder, ep=2)
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # its log must not fill the pipe
    expert_pids = [proc.pid, *descendants(proc.pid)]
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32")
    attached = dict(experts=address, expert_timeout_s=EXPERT_TIMEOUT_S, kv_cache_bytes=1 << 22, **common)
    instances = [PrefillInstance(PrefillSettings(**attached), registry=registry),
                 DecodeInstance(DecodeSettings(**attached), registry=registry),
                 DecodeInstance(DecodeSettings(kv_cache_bytes=1 << 21, **common), registry=registry),  # fewer free
                 RouterInstance(RouterSettings(model=str(folder), local_prefill_max_tokens=0), registry=registry)]
    prefill, decode, standalone, router = instances  # least_load: the attached decode first, for its free blocks
    try:
        wait_until(lambda: len(registry.instances()) == 4)
        prompt, long = [5, 9, 13, 17], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        arrived, streaming = first_delta_then_rest(router.address, prompt, long)
        assert arrived.wait(60) and decode.core.status()["active_requests"] == 1  # the attached one streams
        faulted_at = time.monotonic()
        for pid in expert_pids:
            os.kill(pid, fault)
        wait_until(lambda: decode.core.failed, timeout_s=EXPERT_TIMEOUT_S + 30)
        assert time.monotonic() - faulted_at < EXPERT_TIMEOUT_S + 30  # bounded by the timeout: no rank hangs
        reference = LLM(str(folder), dtype="float32").generate([prompt], long)[0].token_ids  # EOS and on, not
        assert streaming.result(timeout=120) == reference  # transformers' min_new_tokens; migrated: one stream
        assert scrape(router.metrics.url)[("infermesh_migrations_total", ())] == 1
        long_prompt = [5 + i % 200 for i in range(40)]  # prefilled on the attached prefill instance: it fails
        assert generate(router.address, long_prompt)[0] == hf_greedy(hf, long_prompt, 6)[0]
        assert prefill.core.failed and not standalone.core.failed
        spawned = set(descendants(os.getpid())) - before
    finally:
        for instance in instances:
            instance.stop()
        for pid in expert_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert_exited(sorted(spawned))
