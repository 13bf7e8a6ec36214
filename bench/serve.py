"""Disaggregated vs colocated under load: the router driven by Poisson arrivals of a fixed-seed mix of
short chat turns and long documents, on three layouts started with `infermesh up` one after the other:

    colocated      one decode instance that also prefills      (--prefill 0)
    disaggregated  a prefill instance and a decode instance     (--prefill 1)
    cp2            a CP=2 prefill instance and a decode one      (--prefill 1 --prefill-cp 2)

    python bench/serve.py [--rate 0.5] [--requests 40] [--seed 0] [--slo-ttft 5] [--slo-tpot 0.25]
                          [--cpus split] [--max-num-batched-tokens 2048] [--plot bench/serve.png] [--quick]

Per layout: TTFT and TPOT p50/p99 (seen by the client: first streamed token; the gaps after it), output
tokens/s over the run, goodput (requests/s that met both SLOs) and the requests that failed, by status
code (a failure counts as an infinite TTFT and TPOT). Prompts are random token ids (no
prefix-cache hits between requests); every request is greedy with a fixed output length.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # repo root, not bench/: no script here shadows a package

from bench.up import running_mesh  # noqa: E402
from mesh import rpc  # noqa: E402
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402

LAYOUTS = {"colocated": ["--prefill", "0"], "disaggregated": ["--prefill", "1"],
           "cp2": ["--prefill", "1", "--prefill-cp", "2"]}
VOCAB = 49152  # SmolLM2's


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float  # arrival, from the start of the run
    prompt: list[int]
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Outcome:
    ttft_s: float
    tpot_s: float  # mean gap between the tokens after the first
    tokens: int
    error: str = ""  # the status code of a request that failed (its times are then infinite)


def workload(n: int, rate: float, seed: int, document_share: float, document_tokens: int) -> list[Request]:
    """`n` requests, exponential gaps of mean 1/rate; a `document_share` of them are long documents to
    summarise (`document_tokens`, 32 out), the rest chat turns (40-120 tokens, 64 out)."""
    rng = random.Random(seed)
    requests, at = [], 0.0
    for _ in range(n):
        at += rng.expovariate(rate)
        document = rng.random() < document_share
        length = document_tokens if document else rng.randint(40, 120)
        requests.append(Request(at, [rng.randrange(100, VOCAB) for _ in range(length)], 32 if document else 64))
    return requests


def one(stub, request: Request) -> Outcome:
    sampling = common_pb2.SamplingParams(max_tokens=request.output_tokens, temperature=0.0, ignore_eos=True)
    start, times = time.perf_counter(), []
    try:
        for response in stub.Generate(inference_pb2.GenerateRequest(
                token_ids=inference_pb2.TokenIds(ids=request.prompt), sampling=sampling), timeout=600):
            if response.HasField("delta") and response.delta.token_ids:
                times += [time.perf_counter()] * len(response.delta.token_ids)
    except grpc.RpcError as e:
        return Outcome(float("inf"), float("inf"), len(times), e.code().name)
    gaps = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return Outcome(times[0] - start, gaps, len(times))


def run_layout(args: list[str], requests: list[Request], dtype: str) -> tuple[list[Outcome], float]:
    with running_mesh("--dtype", dtype, *args) as address:
        stub = inference_pb2_grpc.InferenceStub(rpc.channel(address))
        one(stub, Request(0.0, list(range(100, 140)), 4))  # warm up

        def arrive(request: Request) -> Outcome:
            time.sleep(max(0.0, start + request.at_s - time.perf_counter()))
            return one(stub, request)

        start = time.perf_counter()
        with ThreadPoolExecutor(len(requests)) as pool:
            outcomes = list(pool.map(arrive, requests))
        return outcomes, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=0.5, help="mean arrivals per second (Poisson)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--document-share", type=float, default=0.2)
    parser.add_argument("--document-tokens", type=int, default=4000)
    parser.add_argument("--slo-ttft", type=float, default=5.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.25, help="seconds")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--cpus", default="split", choices=["split", "shared"], help="infermesh up --cpus")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="infermesh up's: a step's tokens")
    parser.add_argument("--plot", type=Path, help="a PNG of TTFT and TPOT per layout")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 small requests, two layouts")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rate, args.document_tokens, args.document_share = 4, 4.0, 300, 0.5
        args.layouts = ["colocated", "disaggregated"]
    requests = workload(args.requests, args.rate, args.seed, args.document_share, args.document_tokens)
    documents = sum(len(r.prompt) == args.document_tokens for r in requests)
    up = ["--cpus", args.cpus, "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    results = {name: run_layout([*LAYOUTS[name], *up], requests, args.dtype) for name in args.layouts}
    print(f"\n{len(requests)} requests ({documents} documents of {args.document_tokens} tokens, the rest chat turns), "
          f"Poisson {args.rate}/s, seed {args.seed}; SLO: TTFT <= {args.slo_ttft} s, TPOT <= {args.slo_tpot} s\n")
    print("| layout | TTFT p50 s | TTFT p99 s | TPOT p50 s | TPOT p99 s | output tok/s | goodput req/s | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (outcomes, seconds) in results.items():
        ttft, tpot = [o.ttft_s for o in outcomes], [o.tpot_s for o in outcomes]  # a failure counts as infinite
        good = sum(o.ttft_s <= args.slo_ttft and o.tpot_s <= args.slo_tpot for o in outcomes)
        failed = Counter(o.error for o in outcomes if o.error)
        print(f"| {name} | {percentile(ttft, 0.5):.2f} | {percentile(ttft, 0.99):.2f} | {percentile(tpot, 0.5):.3f} | "
              f"{percentile(tpot, 0.99):.3f} | {sum(o.tokens for o in outcomes) / seconds:.1f} | "
              f"{good / seconds:.2f} | {', '.join(f'{n} {code}' for code, n in failed.items()) or 0} |")
    if args.plot:
        plot(results, args.plot)
        print(f"\nplot: {args.plot}")


def plot(results: dict[str, tuple[list[Outcome], float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, (outcomes, _) in results.items():
        for axis, values in ((left, [o.ttft_s for o in outcomes]), (right, [o.tpot_s for o in outcomes])):
            finished = sorted(v for v in values if math.isfinite(v))  # a failed request never reaches the curve
            axis.step(finished, [(i + 1) / len(values) for i in range(len(finished))], where="post", label=name)
    left.set(xlabel="time to first token (s)", ylabel="share of requests", xscale="log")
    right.set(xlabel="time per output token (s)")
    left.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
