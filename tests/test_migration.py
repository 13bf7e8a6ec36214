"""A decode instance killed (SIGKILL) in the middle of a stream: the router resumes the request on another
decode instance and the client sees one stream with no gap and no repeat — the same tokens and text as
the run without the fault, for greedy and for seeded sampling — counted in infermesh_migrations_total.
Real decode processes (SmolLM2) registered in a registry this test serves, a router in this process. The
decode instances stop stepping once the client has the tokens before the kill (`INFERMESH_TEST_HOLD_FILE`,
engine.loop), so the instance to kill is still serving the stream whatever this machine's speed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from mesh import rpc
from mesh.metrics import scrape
from mesh.registry import MemoryRegistry, Role
from mesh.registry.remote import RegistryService
from mesh.settings import RouterSettings
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from router.server import RouterInstance
from tests.helpers import assert_exited, wait_until

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all

QUESTION = [inference_pb2.ChatMessage(role="user", content="Tell me a long story about a dragon and a knight.")]


@pytest.fixture(scope="module")
def mesh():
    registry = MemoryRegistry()
    server, port, _ = rpc.start_server("127.0.0.1", 0, [(internal_pb2_grpc.add_RegistryServicer_to_server,
                                                         RegistryService(registry), "infermesh.v1.Registry")])
    hold = Path(tempfile.mkdtemp(prefix="infermesh-hold-")) / "decode"
    decodes = [subprocess.Popen([sys.executable, "-m", "decode_svc.server", "--model", "smollm2-135m", "--dtype",
                                 "float32", "--registry", f"grpc://127.0.0.1:{port}", "--kv-cache-bytes",
                                 str(64 << 20)], stdout=subprocess.DEVNULL,
                                env={**os.environ, "INFERMESH_TEST_HOLD_FILE": str(hold)}) for _ in range(3)]
    router = RouterInstance(RouterSettings(model="smollm2-135m"), registry=registry)
    try:
        wait_until(lambda: len(registry.instances(Role.DECODE)) == 3, timeout_s=120)
        yield router, registry, decodes, hold
    finally:
        router.stop()
        for p in decodes:
            p.kill()
            p.wait()
        server.stop(None)


def chat(router, sampling: common_pb2.SamplingParams, kill_after: int | None = None, decodes=(),
         hold: Path | None = None):
    """(token ids, text, final) of one streamed chat; with `kill_after`, the decode instances are held once that
    many tokens have arrived, and the one serving the stream is killed before they go on."""
    stub = inference_pb2_grpc.InferenceStub(rpc.channel(router.address))
    tokens, texts, final, arrived = [], [], [], threading.Event()

    def read():
        for r in stub.Chat(inference_pb2.ChatRequest(messages=QUESTION, sampling=sampling), timeout=300):
            if r.HasField("delta"):
                tokens.extend(r.delta.token_ids)
                texts.append(r.delta.text)
                if kill_after is not None and len(tokens) >= kill_after and not arrived.is_set():
                    hold.touch()
                    arrived.set()
            else:
                final.append(r.final)

    reader = threading.Thread(target=read)
    reader.start()
    if kill_after is not None:
        assert arrived.wait(120)
        serving = [i for i in router.registry.instances(Role.DECODE) if internal_pb2_grpc.AdminStub(
            rpc.channel(i.address)).Status(internal_pb2.StatusRequest(), timeout=10).active_requests]
        (victim,) = serving
        (process,) = [p for p in decodes if p.pid == victim.pid]
        process.send_signal(signal.SIGKILL)
        process.wait()
        hold.unlink()
    reader.join(300)
    assert final, "the stream did not finish"
    return tokens, "".join(texts), final[0]


@pytest.mark.parametrize("sampling", [
    common_pb2.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
    common_pb2.SamplingParams(max_tokens=60, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_stream_whose_decode_instance_dies_continues_elsewhere_without_gap_or_repeat(mesh, sampling):
    router, registry, decodes, hold = mesh
    expected_tokens, expected_text, expected_final = chat(router, sampling)
    alive = [p for p in decodes if p.poll() is None]
    migrations = scrape(router.metrics.url).get(("infermesh_migrations_total", ()), 0)
    tokens, text, final = chat(router, sampling, kill_after=10, decodes=decodes, hold=hold)
    assert tokens == expected_tokens and text == expected_text
    assert (final.finish_reason, final.usage.completion_tokens, final.usage.prompt_tokens) == (
        expected_final.finish_reason, 60, expected_final.usage.prompt_tokens)
    assert len([p for p in decodes if p.poll() is None]) == len(alive) - 1  # one instance really died
    assert_exited([p.pid for p in decodes if p.poll() is not None])
    assert scrape(router.metrics.url)[("infermesh_migrations_total", ())] == migrations + 1
    # its record outlives it until its TTL: gone before the next case, which would otherwise be routed there
    wait_until(lambda: len(router.registry.instances(Role.DECODE)) == len(alive) - 1, timeout_s=30)
    admins = [internal_pb2_grpc.AdminStub(rpc.channel(i.address)) for i in registry.instances(Role.DECODE)]
    wait_until(lambda: all(a.Status(internal_pb2.StatusRequest(), timeout=10).kv_blocks_used == 0 for a in admins))
