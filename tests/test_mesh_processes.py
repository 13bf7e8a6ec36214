"""`infermesh up` as real processes on loopback: tokens equal the in-process engine through the router,
with the in-memory registry (KV over gRPC streams) and with Redis (KV over torch p2p pair groups); status
lists every instance; one trace per request spans router, prefill, KV transfer and decode; Ctrl-C leaves no
process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpus import available_cores, parse_cpus, share
from mesh.metrics import scrape
from tests.conftest import TINY_VOCAB
from tests.helpers import assert_exited, descendants, listening, task_files
from tests.test_parity_tiny import hf_greedy
from tests.test_router import GREEDY, generate

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all

INFERMESH = str(Path(sys.executable).parent / "infermesh")


def start_mesh(model: str, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([INFERMESH, "up", "--model", model, "--port", "0", "--dtype", "float32", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    for line in proc.stdout:
        if line.startswith("infermesh ready on "):
            return proc, line.split()[3]
    proc.wait(timeout=30)
    raise AssertionError(f"the mesh did not start (exit {proc.returncode})")


def stop_mesh(proc: subprocess.Popen, pids: list[int]) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert_exited(pids)  # every process it started


def shm_bytes(pid: int) -> int:
    """Bytes held in /dev/shm by the process's staging files (`kvtransfer.shm_arena`)."""
    from kvtransfer.shm_arena import PREFIX, SHM_DIR

    files = [f for f in os.listdir(SHM_DIR) if f.startswith(f"{PREFIX}{pid}-")]
    return sum(os.stat(os.path.join(SHM_DIR, f)).st_blocks * 512 for f in files)


def cores_of(pid: int) -> set[int]:
    """The cores any live thread of `pid` may run on."""
    cores: set[int] = set()
    for status in task_files(pid, "status"):
        cores.update(parse_cpus(status.split("Cpus_allowed_list:")[1].split()[0]))
    return cores


def planned_cores(ranks: list[int]) -> list[set[int]]:
    """What `up --cpus split` gives engine instances of these ranks (decode first): their shares of the cores."""
    return [set(cores) for cores in share(available_cores(), ranks)]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([INFERMESH, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def started(address: str) -> list[dict]:
    """`status --json` of the mesh at `address`: the instances `up` started (not the supervisor itself)."""
    found = json.loads(cli("status", "--target", address, "--json").stdout)["instances"]
    return [i for i in found if i["role"] != "supervisor"]


@pytest.mark.parametrize("registry,transport", [("memory", "grpc_stream"), ("redis", "torch_p2p"),
                                                ("memory", "shared_memory"), ("memory", "mooncake")])
def test_up_serves_the_engines_tokens_and_stops_cleanly(registry, transport, tiny_checkpoint, request, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    spans_file = tmp_path / "spans.jsonl"
    args = ["--registry", request.getfixturevalue("redis_url")] if registry == "redis" else []
    args += ["--prefill-cp", "2", "--decode-tp", "2",  # the heterogeneous layout: CP prefill pushes to TP decode
             "--kv-transport", transport, "--trace", f"file:{spans_file}"]
    if transport == "shared_memory":  # steps of 48 tokens: the longer prompts prefill in chunks on either instance
        args += ["--max-num-batched-tokens", "48"]
    proc, address = start_mesh(str(folder), *args)
    status = json.loads(cli("status", "--target", address, "--json").stdout)
    pids = [i["pid"] for i in status["instances"] if i["role"] != "supervisor"]
    try:
        roles = sorted(i["role"] for i in status["instances"])
        assert roles == ["decode", "prefill", "router", "supervisor"]  # `up` registers itself too
        parallel = {i["role"]: i["parallel"] for i in status["instances"]}
        assert parallel["decode"] == {"tp": 2, "cp": 1, "ep": 1} and parallel["prefill"] == {"tp": 1, "cp": 2, "ep": 1}
        # --cpus split (the default): decode and prefill on their own shares, their ranks with them
        pid = {i["role"]: i["pid"] for i in status["instances"]}
        expected = dict(zip(("decode", "prefill"), planned_cores([2, 2])))
        assert {role: cores_of(pid[role]) for role in expected} == expected
        assert {role: set().union(*map(cores_of, descendants(pid[role]))) for role in expected} == expected
        assert cores_of(pid["router"]) == set(available_cores())  # not an engine: it runs where it may
        if transport == "shared_memory":  # prefill's ranks hold their KV caches in /dev/shm for decode to read
            assert all(shm_bytes(p) > 1 << 20 for p in [pid["prefill"], *descendants(pid["prefill"])])
            assert all(b"--max-num-batched-tokens\x0048\x00" in Path(f"/proc/{pid[role]}/cmdline").read_bytes()
                       for role in ("prefill", "decode"))
            assert not any(shm_bytes(p) for p in [pid["decode"], *descendants(pid["decode"])])
        reference = LLM(str(folder), dtype="float32")
        prompt = "the quick brown fox jumps over the lazy dog " * 8  # disaggregated
        out = cli("generate", prompt, "--target", address, "--max-tokens", "6", "--ignore-eos", "--json")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.splitlines()[-1])
        (expected,) = reference.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert result["token_ids"] == expected.token_ids
        assert result["prompt_token_ids"] == expected.prompt_token_ids
        g = torch.Generator().manual_seed(5)  # 16 concurrent requests, prefilled on decode and disaggregated
        prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist()
                   for n in [4, 20, 70, 130, 9, 66, 100, 41] * 2]
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda p: generate(address, p), prompts))
        assert [tokens for tokens, _ in results] == [o.token_ids for o in reference.generate(prompts, GREEDY)]
        bad = cli("generate", "hi", "--target", address, "--top-p", "0")
        assert bad.returncode == 2 and "top_p must be in (0, 1]" in bad.stderr
        (decode,) = [i for i in status["instances"] if i["role"] == "decode"]
        assert scrape(decode["metrics_url"])[("infermesh_kv_recomputed_requests_total", ())] == 0  # the KV came
        if transport == "mooncake":  # Mooncake's two listeners (its handshake, its tcp transport) bind every
            # interface (README, Security): in each rank of prefill and decode, and in no other process
            ranks = [p for role in ("prefill", "decode") for p in [pid[role], *descendants(pid[role])]]
            others = [proc.pid, pid["router"]]
            wildcard = {p: {a for a in listening([p]) if not a.startswith("127.0.0.1:")} for p in ranks + others}
            assert all(sorted(a.rsplit(":", 1)[0] for a in wildcard[p]) == ["0.0.0.0", "::"] for p in ranks), wildcard
            assert not any(wildcard[p] for p in others)
    finally:
        stop_mesh(proc, pids)
    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    pushes = [s for s in spans if s["name"].startswith("kvtransfer.push")]
    whole = sum(s["name"] == "kvtransfer.push" for s in pushes)  # rank 0's span: every rank's bytes
    # each pushed request: rank 0's push and rank 1's own; the five distinct long prompts at least (a repeated one
    # may find its twin's prefix cached on decode, depending on arrival order, and be prefilled there)
    assert whole == len(pushes) - whole >= 5
    assert all(s["attributes"]["transport"] == transport and s["attributes"]["ok"] for s in pushes)


def test_up_with_expert_instances_serves_an_moe_model_through_them(tiny_checkpoint):
    folder, hf = tiny_checkpoint("qwen3_moe")
    proc, address = start_mesh(str(folder), "--experts", "1", "--expert-ep", "2", "--prefill-cp", "2",
                               "--local-prefill-max-tokens", "20")
    status = started(address)
    pids = [i["pid"] for i in status]
    try:
        (expert,) = [i for i in status if i["role"] == "expert"]
        assert expert["parallel"] == {"tp": 1, "cp": 1, "ep": 2}
        g = torch.Generator().manual_seed(12)
        prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (4, 40, 9, 70)]
        with ThreadPoolExecutor(4) as pool:  # prefilled on decode and on the CP instance, experts on the expert ranks
            results = list(pool.map(lambda p: generate(address, p), prompts))
        assert [tokens for tokens, _ in results] == [hf_greedy(hf, p, 6)[0] for p in prompts]
        attached = json.loads(cli("status", "--target", address, "--json").stdout)["instances"]
        assert [i["active_requests"] for i in attached if i["role"] == "expert"] == [2]  # prefill and decode attached
    finally:
        stop_mesh(proc, pids)


def test_when_a_role_has_no_instance_left_up_stops_every_other_and_exits_with_the_reason(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")  # --max-restarts 0: the killed decode instance is never restarted
    proc, address = start_mesh(str(folder), "--prefill-cp", "2", "--decode-tp", "2", "--max-restarts", "0")
    instances = started(address)
    pids = [i["pid"] for i in instances]
    everything = pids + [child for pid in pids for child in descendants(pid)]
    assert len(everything) == 5  # router, prefill and its second CP rank, decode and its second TP rank
    (decode,) = [i["pid"] for i in instances if i["role"] == "decode"]
    os.kill(decode, signal.SIGKILL)
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 1 and "decode-0 was killed by signal 9; left down after 0 restarts" in rest
    assert "no decode instance left that can serve" in rest
    assert_exited(everything)


def test_one_request_is_one_trace_across_router_prefill_transfer_and_decode(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    spans_file = tmp_path / "spans.jsonl"
    proc, address = start_mesh(str(folder), "--trace", f"file:{spans_file}", "--prefill-cp", "2", "--cpus", "shared")
    pids = [i["pid"] for i in started(address)]
    try:
        assert all(cores_of(pid) == set(available_cores()) for pid in pids)  # shared: every core for every process
        out = cli("generate", "the quick brown fox jumps over the lazy dog " * 8, "--target", address,
                  "--max-tokens", "4")
        assert out.returncode == 0, out.stderr
    finally:
        stop_mesh(proc, pids)
    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    by_name = {s["name"]: s for s in spans}
    assert {"router.generate", "router.route", "decode.reserve", "prefill.run", "kvtransfer.push",
            "decode.request"} <= set(by_name)
    root = by_name["router.generate"]
    assert len({s["trace_id"] for s in spans}) == 1
    for name in ("router.route", "decode.reserve", "prefill.run", "decode.request"):
        assert by_name[name]["parent_id"] == root["span_id"], name
    assert by_name["kvtransfer.push"]["parent_id"] == by_name["prefill.run"]["span_id"]
    assert by_name["kvtransfer.push"]["attributes"]["bytes"] > 0
    rank_push = by_name["kvtransfer.push.rank"]  # prefill's second CP rank pushes its own tokens
    assert rank_push["parent_id"] == by_name["prefill.run"]["span_id"] and rank_push["attributes"]["ok"]
    assert rank_push["attributes"]["prefill_rank"] == 1 and rank_push["pid"] != by_name["prefill.run"]["pid"]
    assert len({s["pid"] for s in spans}) == 4  # router, both prefill ranks and decode
