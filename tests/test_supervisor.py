"""`infermesh up` keeps its mesh serving through crashes, by its own supervisor (mesh.children): a decode
instance killed (SIGKILL) in the middle of a 1,000-token stream is restarted while the router's migration
carries the stream to the other decode instance, which ends it with the in-process engine's tokens, no gap,
no repeat; a prefill instance killed with a request in hand (its KV not yet pushed) is restarted and decode
recomputes the prompt; the router killed between requests is restarted on the same ports and serves gRPC
and the OpenAI front again; the in-memory registry killed comes back on its port, the router serving on
its snapshot meanwhile, and every instance registers again by its heartbeat; a process that fails at
every start (its model gone) is left down after --max-restarts and the mesh serves on with the others.
`status` shows each restart and why; the supervisor counts them in infermesh_instance_restarts_total{role}.

One mesh for the whole module, a tiny checkpoint whose context holds the long stream. Every engine holds
its steps while the hold file exists (`INFERMESH_TEST_HOLD_FILE`, engine.loop), so each kill lands at a
known point whatever this machine's speed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from mesh import rpc
from mesh.metrics import scrape
from protos.convert import sampling_message
from protos.infermesh.v1 import inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from tests.conftest import TINY_VOCAB
from tests.helpers import assert_exited, wait_until
from tests.test_mesh_processes import cli, start_mesh, stop_mesh
from tests.test_router import generate

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all


@dataclass
class Mesh:
    process: object
    address: str
    model: Path
    hold: Path
    reference: LLM


@pytest.fixture(scope="module")
def mesh(tiny_checkpoint, tmp_path_factory):
    folder, _ = tiny_checkpoint("llama")
    model = tmp_path_factory.mktemp("supervised") / "tiny-llama"
    shutil.copytree(folder, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))  # RoPE: no weight
    hold = model.parent / "hold"
    proc, address = start_mesh(str(model), "--decode", "2", "--http-port", "0", "--max-restarts", "2",
                               "--local-prefill-max-tokens", "8", env={"INFERMESH_TEST_HOLD_FILE": str(hold)})
    pids = [i["pid"] for i in status(address)["instances"] if i["role"] != "supervisor"]
    try:
        yield Mesh(proc, address, model, hold, LLM(str(model), dtype="float32"))
    finally:
        hold.unlink(missing_ok=True)
        if model.parent.joinpath("gone").exists():
            model.parent.joinpath("gone").rename(model)
        stop_mesh(proc, pids + [p["pid"] for p in status(address)["processes"]])


def status(address: str) -> dict:
    out = cli("status", "--target", address, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def processes(address: str) -> dict[str, dict]:
    return {p["name"]: p for p in status(address)["processes"]}


def instances(address: str, role: str) -> list[dict]:
    return [i for i in status(address)["instances"] if i["role"] == role and i["state"] == "serving"]


def restarts(address: str) -> dict[str, float]:
    (supervisor,) = [i for i in status(address)["instances"] if i["role"] == "supervisor"]
    return {dict(labels)["role"]: value for (name, labels), value in scrape(supervisor["metrics_url"]).items()
            if name == "infermesh_instance_restarts_total"}


def active(address: str) -> int:
    return internal_pb2_grpc.AdminStub(rpc.channel(address)).Status(internal_pb2.StatusRequest(),
                                                                    timeout=10).active_requests


def back_in_service(mesh: Mesh, name: str, role: str, count: int, killed: int) -> dict:
    """Wait until `name` runs again (restarted once more, a new pid) and the mesh has `count` serving instances
    of `role` again, that one among them; its process row."""
    def back() -> bool:
        row = processes(mesh.address)[name]
        serving = {i["pid"] for i in instances(mesh.address, role)}
        return row["state"] == "running" and row["pid"] != killed and len(serving) == count and row["pid"] in serving
    wait_until(back, timeout_s=120)
    return processes(mesh.address)[name]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stream(mesh: Mesh, ids: list[int], params: SamplingParams,
           hold_after: int | None = None) -> tuple[threading.Thread, dict]:
    """A Generate stream read on a thread; with `hold_after`, every engine is held once that many tokens have
    arrived (`arrived` set). Its tokens and final land in the returned dict."""
    result = {"tokens": [], "final": None, "arrived": threading.Event()}

    def read():
        stub = inference_pb2_grpc.InferenceStub(rpc.channel(mesh.address))
        request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=ids),
                                                sampling=sampling_message(params))
        for r in stub.Generate(request, timeout=300):
            if r.HasField("delta"):
                result["tokens"].extend(r.delta.token_ids)
                if hold_after is not None and len(result["tokens"]) >= hold_after and not result["arrived"].is_set():
                    mesh.hold.touch()
                    result["arrived"].set()
            else:
                result["final"] = r.final

    reader = threading.Thread(target=read)
    reader.start()
    return reader, result


def test_a_decode_instance_killed_mid_stream_is_restarted_and_the_stream_ends_as_the_engine_would(mesh):
    ids, params = prompt(40, 1), SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    (expected,) = mesh.reference.generate([ids], params)
    reader, result = stream(mesh, ids, params, hold_after=50)
    assert result["arrived"].wait(120)
    (victim,) = [i for i in instances(mesh.address, "decode") if active(i["address"])]
    (name,) = [n for n, p in processes(mesh.address).items() if p["pid"] == victim["pid"]]
    os.kill(victim["pid"], signal.SIGKILL)
    mesh.hold.unlink()
    reader.join(300)
    assert result["tokens"] == expected.token_ids and result["final"].usage.completion_tokens == 1000
    row = back_in_service(mesh, name, "decode", 2, victim["pid"])
    assert row["restarts"] == 1 and row["last_exit"] == -9 and "killed by signal 9" in row["reason"]
    assert restarts(mesh.address)["decode"] == 1
    (router,) = instances(mesh.address, "router")
    assert scrape(router["metrics_url"])[("infermesh_migrations_total", ())] == 1
    assert_exited([victim["pid"]])
    wait_until(lambda: all(i["kv_blocks_used"] == 0 for i in instances(mesh.address, "decode")))  # nothing held
    assert generate(mesh.address, ids[:20])[0] == mesh.reference.generate([ids[:20]], GREEDY)[0].token_ids


def test_a_prefill_instance_killed_with_a_request_in_hand_is_restarted_and_decode_recomputes(mesh):
    ids, params = prompt(60, 2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (expected,) = mesh.reference.generate([ids], params)
    mesh.hold.touch()  # prefill takes the request, holds it, and pushes nothing yet
    reader, result = stream(mesh, ids, params)
    (prefill,) = instances(mesh.address, "prefill")
    wait_until(lambda: active(prefill["address"]) == 1)
    os.kill(prefill["pid"], signal.SIGKILL)
    mesh.hold.unlink()
    reader.join(300)
    assert result["tokens"] == expected.token_ids
    recomputed = [scrape(i["metrics_url"]).get(("infermesh_kv_recomputed_requests_total", ()), 0)
                  for i in instances(mesh.address, "decode")]
    assert sorted(recomputed) == [0, 1]  # decode computed the prompt the dead prefill never pushed
    row = back_in_service(mesh, "prefill-0", "prefill", 1, prefill["pid"])
    assert row["restarts"] == 1 and restarts(mesh.address)["prefill"] == 1
    again = prompt(60, 3)  # disaggregated through the restarted instance
    assert generate(mesh.address, again)[0] == mesh.reference.generate([again], GREEDY)[0].token_ids
    (restarted,) = instances(mesh.address, "prefill")
    wait_until(lambda: active(restarted["address"]) == 0)


def test_the_router_killed_between_requests_serves_again_on_the_same_ports(mesh):
    (router,) = instances(mesh.address, "router")
    ids = prompt(30, 4)
    (expected,) = mesh.reference.generate([ids], GREEDY)
    os.kill(router["pid"], signal.SIGKILL)

    def serves() -> bool:
        try:
            return generate(mesh.address, ids)[0] == expected.token_ids
        except grpc.RpcError as e:
            assert e.code() is grpc.StatusCode.UNAVAILABLE, e
            return False
    wait_until(serves, timeout_s=120)
    body = {"model": str(mesh.model), "prompt": ids, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    answer = httpx.post(f"http://{router['http_address']}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected.text
    row = processes(mesh.address)["router"]
    assert row["restarts"] == 1 and row["pid"] != router["pid"] and restarts(mesh.address)["router"] == 1


def test_the_registry_killed_comes_back_on_its_port_and_every_instance_registers_again(mesh):
    registry = processes(mesh.address)["registry"]
    ids = prompt(30, 6)
    (expected,) = mesh.reference.generate([ids], GREEDY)
    os.kill(registry["pid"], signal.SIGKILL)
    assert generate(mesh.address, ids)[0] == expected.token_ids  # the router routes on what it last read

    def registered_again() -> bool:
        out = cli("status", "--target", mesh.address, "--json")  # the router lists what the registry holds
        if out.returncode != 0:
            return False
        found = json.loads(out.stdout)
        restarted = [p["restarts"] for p in found["processes"] if p["name"] == "registry"]  # none: no supervisor yet
        roles = sorted(i["role"] for i in found["instances"] if i["state"] == "serving")
        return restarted == [1] and roles == ["decode", "decode", "prefill", "router", "supervisor"]
    wait_until(registered_again, timeout_s=120)
    assert restarts(mesh.address)["registry"] == 1
    assert generate(mesh.address, ids)[0] == expected.token_ids


def test_a_process_that_fails_at_every_start_is_left_down_and_the_mesh_serves_on(mesh):
    mesh.model.rename(mesh.model.parent / "gone")  # what every start of an instance loads first
    decodes = instances(mesh.address, "decode")
    victim = decodes[0]
    (name,) = [n for n, p in processes(mesh.address).items() if p["pid"] == victim["pid"]]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: processes(mesh.address)[name]["state"] == "down", timeout_s=120)
    row = processes(mesh.address)[name]
    assert row["reason"].endswith("left down after 2 restarts in 600 s (--max-restarts 2)") and row["last_exit"] > 0
    assert mesh.process.poll() is None  # the mesh still runs...
    wait_until(lambda: len(instances(mesh.address, "decode")) == 1)
    ids = prompt(30, 5)  # ...and serves, on the other decode instance
    assert generate(mesh.address, ids)[0] == mesh.reference.generate([ids], GREEDY)[0].token_ids
    assert_exited([victim["pid"]])


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
