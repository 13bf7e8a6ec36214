"""Faults around a stream, with real processes (SmolLM2 in fp32: a prefill instance of 2 CP ranks, a decode
instance of 2 TP ranks, a router, all registered in a registry this test serves):

- the router killed (SIGKILL) mid-stream: the client gets UNAVAILABLE, decode frees the abandoned stream's
  KV blocks, and a new router serves the retry with the engine's tokens;
- a client deadline that passes mid-decode, and one that passes mid-prefill: DEADLINE_EXCEEDED, and the
  work stops downstream: KV blocks and running requests back to zero on prefill and decode (a TP
  instance's blocks are rank 0's block tables, which every rank's cache follows);
- the prefill instance killed (SIGKILL) while it holds the request: the request completes on decode
  (it recomputes the prompt in its reservation) with the engine's tokens, and its KV is freed.

Each instance is held where a test needs it (`Mesh.hold`: its engine loop runs no step while held,
`engine.loop`), so what a test asserts does not depend on how fast this machine computes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import grpc
import pytest

from engine import LLM, SamplingParams
from mesh import rpc
from mesh.registry import MemoryRegistry, Role
from mesh.registry.remote import RegistryService
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from tests.helpers import assert_exited, descendants, wait_until

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all

MODEL = "smollm2-135m"
GREEDY = common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class Mesh:
    """Instances as processes registered in `registry`; `start(role)` adds one, `kill(process)` SIGKILLs it."""

    def __init__(self) -> None:
        self.registry = MemoryRegistry()
        self.server, port, _ = rpc.start_server("127.0.0.1", 0, [(internal_pb2_grpc.add_RegistryServicer_to_server,
                                                                  RegistryService(self.registry),
                                                                  "infermesh.v1.Registry")])
        self.common = ["--model", MODEL, "--registry", f"grpc://127.0.0.1:{port}"]
        self.processes: list[subprocess.Popen] = []
        self.holds = Path(tempfile.mkdtemp(prefix="infermesh-holds-"))

    def start(self, module: str, *args: str) -> subprocess.Popen:
        hold = self.holds / module.split(".")[0]  # one per service: prefill_svc, decode_svc, router
        process = subprocess.Popen([sys.executable, "-m", module, *self.common, *args], stdout=subprocess.DEVNULL,
                                   env={**os.environ, "INFERMESH_TEST_HOLD_FILE": str(hold)})
        self.processes.append(process)
        return process

    @contextlib.contextmanager
    def hold(self, service: str):
        """While inside, the instances of `service` (e.g. "decode_svc") run no engine step."""
        (self.holds / service).touch()
        try:
            yield
        finally:
            (self.holds / service).unlink()

    def address(self, role: Role) -> str:
        wait_until(lambda: self.registry.instances(role), timeout_s=180)
        return self.registry.instances(role)[0].address

    def kill(self, process: subprocess.Popen) -> None:
        ranks = descendants(process.pid)
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert_exited(ranks)  # its ranks follow it

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        self.server.stop(None)


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    try:
        engine = ["--dtype", "float32", "--kv-cache-bytes", str(384 << 20)]
        m.prefill = m.start("prefill_svc.server", "--cp", "2", *engine)
        m.decode = m.start("decode_svc.server", "--tp", "2", *engine,
                           "--reservation-lease-s", "600")  # freed by the mesh's own cancels, not by a lease
        m.router = m.start("router.server", "--local-prefill-max-tokens", "0")  # every prompt through prefill
        for role in (Role.PREFILL, Role.DECODE, Role.ROUTER):
            m.address(role)
        yield m
    finally:
        m.close()


@pytest.fixture(scope="module")
def reference():
    return LLM(MODEL, dtype="float32")


def status(address: str) -> internal_pb2.InstanceStatus:
    return internal_pb2_grpc.AdminStub(rpc.channel(address)).Status(internal_pb2.StatusRequest(), timeout=10)


def idle(mesh: Mesh, *roles: Role) -> bool:
    """No KV block held and no request running on the live instances of `roles`."""
    found = [status(i.address) for role in roles for i in mesh.registry.instances(role)]
    return bool(found) and all(s.kv_blocks_used == 0 and s.active_requests == 0 for s in found)


def stream(address: str, prompt: list[int], sampling: common_pb2.SamplingParams, timeout: float = 300):
    return inference_pb2_grpc.InferenceStub(rpc.channel(address)).Generate(
        inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt), sampling=sampling),
        timeout=timeout)


def tokens_of(responses) -> list[int]:
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


def expected(reference: LLM, prompt: list[int], sampling: common_pb2.SamplingParams) -> list[int]:
    params = SamplingParams(max_tokens=sampling.max_tokens, temperature=0.0, ignore_eos=True)
    return reference.generate([prompt], params)[0].token_ids


def test_a_router_killed_mid_stream_leaves_no_kv_and_a_new_router_serves_the_retry(mesh, reference):
    prompt = reference.tokenizer.encode("Tell me a long story about a dragon and a knight.")
    long_answer = common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    responses = stream(mesh.address(Role.ROUTER), prompt, long_answer)
    assert next(responses).HasField("delta")  # streaming
    mesh.kill(mesh.router)
    with pytest.raises(grpc.RpcError) as e:
        list(responses)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: idle(mesh, Role.PREFILL, Role.DECODE), timeout_s=30)  # the abandoned stream was freed

    wait_until(lambda: not mesh.registry.instances(Role.ROUTER), timeout_s=30)  # its record expires
    mesh.router = mesh.start("router.server", "--local-prefill-max-tokens", "0")
    retried = tokens_of(stream(mesh.address(Role.ROUTER), prompt, GREEDY))
    assert retried == expected(reference, prompt, GREEDY)


def test_a_deadline_that_passes_mid_decode_stops_the_work_downstream_and_frees_its_kv(mesh, reference):
    router = mesh.address(Role.ROUTER)
    prompt, sampling = [5, 6, 7] * 30, common_pb2.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    received: list = []
    with contextlib.ExitStack() as hold, pytest.raises(grpc.RpcError) as e:
        for response in stream(router, prompt, sampling, timeout=10.0):
            if not tokens_of(received) and tokens_of([response]):  # the first token: decode steps no more
                hold.enter_context(mesh.hold("decode_svc"))
            received.append(response)
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(tokens_of(received)) < sampling.max_tokens
    wait_until(lambda: idle(mesh, Role.PREFILL, Role.DECODE), timeout_s=30)
    assert tokens_of(stream(router, prompt[:40], GREEDY)) == expected(reference, prompt[:40], GREEDY)  # serving


def test_a_deadline_that_passes_mid_prefill_stops_the_work_downstream_and_frees_its_kv(mesh, reference):
    router = mesh.address(Role.ROUTER)
    before = {role: status(mesh.address(role)).total_requests for role in (Role.PREFILL, Role.DECODE)}
    prompt = [5 + i % 3000 for i in range(400)]
    received: list = []
    with mesh.hold("prefill_svc"), pytest.raises(grpc.RpcError) as e:
        received.extend(stream(router, prompt, GREEDY, timeout=5.0))
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and received == []
    assert status(mesh.address(Role.PREFILL)).total_requests == before[Role.PREFILL] + 1  # it got there, held
    assert status(mesh.address(Role.DECODE)).total_requests == before[Role.DECODE]  # reserved, never started
    wait_until(lambda: idle(mesh, Role.PREFILL, Role.DECODE), timeout_s=30)
    assert tokens_of(stream(router, prompt[:40], GREEDY)) == expected(reference, prompt[:40], GREEDY)  # serving


def test_a_prefill_killed_while_it_holds_the_request_is_recomputed_on_decode(mesh, reference):
    router = mesh.address(Role.ROUTER)
    prefill = mesh.registry.instances(Role.PREFILL)[0]
    prompt = [5 + i % 3000 for i in range(3000)]
    result: list = []
    with mesh.hold("prefill_svc"):  # it takes the request and computes none of it until it is killed
        reader = threading.Thread(target=lambda: result.append(tokens_of(stream(router, prompt, GREEDY))))
        reader.start()
        wait_until(lambda: status(prefill.address).active_requests > 0, timeout_s=60)
        mesh.kill(mesh.prefill)
    reader.join(300)
    assert result == [expected(reference, prompt, GREEDY)]  # completed, exact
    wait_until(lambda: idle(mesh, Role.DECODE), timeout_s=30)
