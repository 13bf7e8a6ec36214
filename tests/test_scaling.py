"""Operating a local mesh with the CLI, as real processes under a steady stream of requests: `scale decode
1 -> 2 -> 1` and `scale prefill 0` lose no request and change no token; the new instance gets traffic; the
drained one leaves the registry and its process exits; `drain` of a busy instance finishes its stream."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpus import format_cpus
from mesh.rpc import channel
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc
from tests.conftest import TINY_VOCAB
from tests.helpers import assert_exited, wait_until
from tests.test_mesh_processes import cli, cores_of, planned_cores, start_mesh, started, stop_mesh
from tests.test_router import GREEDY, generate

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all


def instances(address: str, role: str | None = None) -> list[dict]:
    return [i for i in started(address) if role in (None, i["role"])]


class Traffic:
    """Requests one after another from `streams` threads until stopped: each answer checked against the engine."""

    def __init__(self, address: str, folder: str, streams: int = 3) -> None:
        g = torch.Generator().manual_seed(21)
        self.prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (6, 30, 50, 9, 70, 14)]
        self.expected = [o.token_ids for o in LLM(folder, dtype="float32").generate(self.prompts, GREEDY)]
        self.address, self.done, self.failures = address, threading.Event(), []
        self.served = 0
        self.pool = ThreadPoolExecutor(streams)
        self.futures = [self.pool.submit(self._run, i) for i in range(streams)]

    def _run(self, stream: int) -> None:
        turn = stream
        while not self.done.is_set():
            index = turn % len(self.prompts)
            try:
                tokens, _ = generate(self.address, self.prompts[index])
                if tokens != self.expected[index]:
                    self.failures.append(f"prompt {index}: {tokens} != {self.expected[index]}")
                self.served += 1
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.failures.append(repr(e))
            turn += 1

    def stop(self) -> None:
        self.done.set()
        for future in self.futures:
            future.result()
        self.pool.shutdown()


def cpu_flags(pid: int) -> list[str]:
    """The --cpus and --borrow-cpus flags (with their values) the process was started with."""
    with open(f"/proc/{pid}/cmdline") as f:
        args = f.read().split("\0")
    return [arg for flag, value in zip(args, args[1:]) if flag in ("--cpus", "--borrow-cpus") for arg in (flag, value)]


def test_scaling_decode_up_and_down_and_prefill_to_zero_loses_no_request(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    proc, address = start_mesh(str(folder), "--local-prefill-max-tokens", "20")
    pids = [i["pid"] for i in instances(address)]
    traffic = Traffic(address, str(folder))
    try:  # --cpus split: decode and prefill on their own cores, decode's engine on prefill's too while it idles
        pid = {i["role"]: i["pid"] for i in instances(address)}
        decode_cores, prefill_cores = planned_cores([1, 1])
        assert cores_of(pid["prefill"]) == prefill_cores
        assert decode_cores <= cores_of(pid["decode"]) <= decode_cores | prefill_cores
        up = cli("scale", "decode", "2", "--target", address)
        assert up.returncode == 0, up.stderr
        (started,) = [line.split()[0] for line in up.stdout.splitlines() if line.endswith(" started")]
        decodes = instances(address, "decode")
        assert started in [d["id"] for d in decodes] and len(decodes) == 2
        assert all(d["state"] == "serving" for d in decodes)
        new_pid = next(d["pid"] for d in decodes if d["id"] == started)
        first_pid = next(d["pid"] for d in decodes if d["id"] != started)
        lendable = ["--borrow-cpus", format_cpus(prefill_cores - decode_cores)] if prefill_cores - decode_cores else []
        assert cpu_flags(first_pid) == ["--cpus", format_cpus(decode_cores), *lendable]
        assert cpu_flags(new_pid) == cpu_flags(first_pid)  # past the plan: it shares the planned decode's cores
        wait_until(lambda: next(d["total_requests"] for d in instances(address, "decode") if d["id"] == started) > 0,
                   timeout_s=60)  # the new instance gets traffic
        down = cli("scale", "decode", "1", "--target", address)
        assert down.returncode == 0, down.stderr
        assert [line.split()[0] for line in down.stdout.splitlines() if line.endswith(" drained")] == [started]
        assert started not in [d["id"] for d in instances(address, "decode")]  # it left the registry
        assert_exited([new_pid])  # and its process exited
        served_before = traffic.served
        none = cli("scale", "prefill", "0", "--target", address)
        assert none.returncode == 0, none.stderr
        assert instances(address, "prefill") == []
        wait_until(lambda: traffic.served >= served_before + 6, timeout_s=60)  # decode prefills everything now
    finally:
        traffic.stop()
        stop_mesh(proc, pids)
    assert traffic.failures == [] and traffic.served > 0


def test_drain_of_a_busy_instance_finishes_its_stream_and_the_mesh_keeps_serving():
    proc, address = start_mesh("smollm2-135m", "--decode", "2", "--prefill", "0")  # a stream of seconds
    pids = [i["pid"] for i in instances(address)]
    try:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(generate, address, [5, 6, 7], long)

            def busy() -> list[dict]:  # live, from each decode instance (the registry lags a heartbeat)
                return [d for d in instances(address, "decode") if internal_pb2_grpc.AdminStub(channel(
                    d["address"])).Status(internal_pb2.StatusRequest(), timeout=10).active_requests]

            wait_until(busy)
            (target,) = busy()
            table = cli("status", "--target", address).stdout  # the operator's view: totals, then instances
            assert "roles" in table and target["id"] in table and target["metrics_url"] in table
            drained = cli("drain", target["id"], "--target", address)
            assert drained.returncode == 0 and drained.stdout.strip() == f"{target['id']} DRAINING", drained.stderr
            assert [i["state"] for i in instances(address, "decode") if i["id"] == target["id"]] == ["draining"]
            waited = cli("drain", target["id"], "--target", address, "--wait")  # again: it is draining already
            assert waited.returncode == 0, waited.stderr
            assert waited.stdout.splitlines() == [f"{target['id']} DRAINING", f"{target['id']} left"]
            tokens, final = streaming.result()
        assert len(tokens) == 200 and final.usage.completion_tokens == 200  # finished, not cut
        assert_exited([target["pid"]])
        remaining = [d["id"] for d in instances(address, "decode")]
        assert len(remaining) == 1 and target["id"] not in remaining
        tokens, _ = generate(address, [8, 9, 10])  # the other decode instance serves
        assert len(tokens) == GREEDY.max_tokens
        assert proc.poll() is None  # `up` let the drained process go; it did not take the mesh down
    finally:
        stop_mesh(proc, pids)


def test_plan_reads_the_live_metrics_and_applies_what_the_slo_asks(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    proc, address = start_mesh(str(folder), "--local-prefill-max-tokens", "20")
    pids = [i["pid"] for i in instances(address)]
    traffic = Traffic(address, str(folder), streams=2)
    try:  # a 1 ms TTFT SLO no request meets: prefill must grow; a 10 s TPOT SLO every one meets: decode holds
        out = cli("plan", "--target", address, "--windows", "1", "--interval-s", "3", "--ttft-slo-ms", "1",
                  "--tpot-slo-ms", "10000", "--apply")
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0].startswith("prefill 1 -> 2, decode 1 -> 1: prefill (TTFT): p90 ")
        assert any(line.endswith(" started") for line in out.stdout.splitlines())
        assert len(instances(address, "prefill")) == 2 and len(instances(address, "decode")) == 1
    finally:
        traffic.stop()
        stop_mesh(proc, pids + [i["pid"] for i in instances(address, "prefill")])
    assert traffic.failures == []
