"""A bounded soak (it stops by itself): 64 concurrent streams for 30 s against `infermesh up` with 2 prefill
and 2 decode instances (real processes, loopback). Every request either completes with exactly the engine's
tokens (no token missing, repeated or out of order) or fails with an explicit status (only load shedding
is expected); afterwards every instance holds no KV block and runs no request, and no process grew past
its warmed-up memory by more than a bound. `pytest tests/test_soak.py -s` prints its figures."""

from __future__ import annotations

import collections
import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from engine import LLM, SamplingParams
from mesh import rpc
from protos.convert import sampling_message
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from tests.conftest import TINY_VOCAB
from tests.helpers import descendants, wait_until
from tests.test_mesh_processes import start_mesh, started, stop_mesh

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all

STREAMS, DURATION_S = 64, 30.0
GROWTH_BOUND_MB = 64  # per process, from warmed up to after the soak: thousands of requests must not pile up


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Soak:
    """`streams` threads sending requests one after another until `duration_s` has passed."""

    def __init__(self, address: str, workload: list[tuple[list[int], int, list[int]]]) -> None:
        self.address, self.workload = address, workload
        self.outcomes: collections.Counter = collections.Counter()
        self.wrong: list[str] = []
        self._lock = threading.Lock()

    def run(self, streams: int, duration_s: float) -> None:
        end = time.monotonic() + duration_s
        threads = [threading.Thread(target=self._stream, args=(i, end)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _stream(self, seed: int, end: float) -> None:
        stub, pick = inference_pb2_grpc.InferenceStub(rpc.channel(self.address)), random.Random(seed)
        while time.monotonic() < end:
            prompt, max_tokens, expected = pick.choice(self.workload)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt),
                                                    sampling=sampling_message(params))
            tokens, final = [], None
            try:
                for response in stub.Generate(request, timeout=120):
                    if response.HasField("delta"):
                        tokens += response.delta.token_ids
                    else:
                        final = response.final
                outcome = "ok"
                if tokens != expected or final is None or final.usage.completion_tokens != len(tokens) \
                        or final.finish_reason != common_pb2.FINISH_REASON_LENGTH:
                    with self._lock:
                        self.wrong.append(f"{prompt[:4]}...: {tokens} != {expected}")
            except grpc.RpcError as e:
                outcome = e.code().name
            with self._lock:
                self.outcomes[outcome] += 1


def test_64_streams_for_30_seconds_lose_nothing_and_leave_nothing(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    proc, address = start_mesh(str(folder), "--prefill", "2", "--decode", "2", "--local-prefill-max-tokens", "16")
    instances = started(address)
    pids = [i["pid"] for i in instances]
    g = random.Random(11)
    prompts = [[g.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (3, 9, 17, 24, 33, 48, 60, 80)]
    budgets = [4 + 3 * i for i in range(len(prompts))]
    reference = LLM(str(folder), dtype="float32")
    workload = [(p, n, reference.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
                 .token_ids) for p, n in zip(prompts, budgets)]
    try:
        Soak(address, workload).run(streams=len(workload), duration_s=3)  # warm up: every path once
        processes = pids + [child for pid in pids for child in descendants(pid)]  # ranks too
        warm = {pid: rss_mb(pid) for pid in processes}
        peak = dict(warm)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(1.0):
                for pid in processes:
                    peak[pid] = max(peak[pid], rss_mb(pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        soak = Soak(address, workload)
        started_at = time.monotonic()
        soak.run(STREAMS, DURATION_S)
        elapsed = time.monotonic() - started_at
        done.set()
        sampler.join()

        def idle() -> bool:
            statuses = [internal_pb2_grpc.AdminStub(rpc.channel(i["address"])).Status(
                internal_pb2.StatusRequest(), timeout=10) for i in instances if i["role"] in ("prefill", "decode")]
            return all(s.kv_blocks_used == 0 and s.active_requests == 0 for s in statuses)

        wait_until(idle, timeout_s=30)
        after = {pid: rss_mb(pid) for pid in processes}
        print(f"\nsoak: {STREAMS} streams, {elapsed:.0f} s, {sum(soak.outcomes.values())} requests, "
              f"outcomes {dict(soak.outcomes)}, wrong {len(soak.wrong)}; RSS MB warm/peak/after, all processes: "
              f"{sum(warm.values()):.0f}/{sum(peak.values()):.0f}/{sum(after.values()):.0f}; largest growth "
              f"{max(after[p] - warm[p] for p in processes):.1f} MB")
        assert soak.wrong == []
        assert soak.outcomes["ok"] > 0 and set(soak.outcomes) <= {"ok", "RESOURCE_EXHAUSTED"}
        assert {p: round(after[p] - warm[p]) for p in processes if after[p] - warm[p] > GROWTH_BOUND_MB} == {}
    finally:
        stop_mesh(proc, pids)
