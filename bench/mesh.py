"""The mesh against the engine it serves: decode tokens/s to N concurrent greedy streams, in-process
(`LLM.generate` of N prompts) and through `infermesh up --prefill 0` (client -> router -> decode over
gRPC, the streams from one asyncio client), one after the other on this machine, with the router's CPU
time per token streamed (read from /proc: its relay's cost, which the engine feels as stolen cycles); what
the router adds to the time to first token (the same one-token request to the router and straight to decode's Decode,
alternately); and a matmul timed on the main thread and on another one (the reason a service drives its
engine from its main thread).

    python bench/mesh.py [--streams 1 8 32] [--tokens 200] [--dtype bfloat16] [--ttft-samples 100]
                         [--no-batch-invariant] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # repo root, not bench/: no script here shadows a package

from bench.up import running_mesh  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from mesh import rpc  # noqa: E402
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc  # noqa: E402,E501

PROMPT = "Tell me a long story about a dragon and a knight."
# ~40 tokens, more than one KV block: the router reads the prefix hits of its blocks, as for a real chat turn
TTFT_PROMPT = ("You are a helpful assistant who answers briefly. The user asks: tell me a long story about a "
               "dragon and a knight who meet on a bridge over a river at dawn.")


def matmul_us(rows: int = 1, dim: int = 576, out: int = 1536, runs: int = 2000) -> float:
    x, w = torch.randn(rows, dim), torch.randn(dim, out)
    for _ in range(200):
        x @ w
    start = time.perf_counter()
    for _ in range(runs):
        x @ w
    return (time.perf_counter() - start) / runs * 1e6


def on_another_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def in_process(streams: list[int], tokens: int, dtype: str, batch_invariant: bool) -> dict[int, float]:
    llm = LLM("smollm2-135m", dtype=dtype, batch_invariant=batch_invariant)
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))
    rates = {}
    for n in streams:
        start = time.monotonic()
        llm.generate([ids] * n, params)
        rates[n] = n * tokens / (time.monotonic() - start)
    llm.close()
    return rates


def first_token_ms(responses) -> float:
    start = time.perf_counter()
    next(iter(responses))
    elapsed = (time.perf_counter() - start) * 1e3
    for _ in responses:  # the rest of the (one-token) stream
        pass
    return elapsed


def router_ttft(address: str, samples: int) -> dict[str, list[float]]:
    """TTFT (ms) of one greedy token for the same prompt ids through the router (as token ids, as text) and
    straight to the decode instance, the three alternating (the prompt is in decode's prefix cache each time)."""
    channel = rpc.channel(address)
    instances = internal_pb2_grpc.AdminStub(channel).ListInstances(internal_pb2.ListInstancesRequest()).instances
    decode = internal_pb2_grpc.DecodeStub(rpc.channel(next(i.address for i in instances
                                                          if i.role == common_pb2.ROLE_DECODE)))
    router = inference_pb2_grpc.InferenceStub(channel)
    one = common_pb2.SamplingParams(max_tokens=1, temperature=0.0)
    ids = list(next(r for r in router.Generate(inference_pb2.GenerateRequest(text=TTFT_PROMPT, sampling=one))
                    if r.HasField("final")).final.prompt_token_ids)
    times: dict[str, list[float]] = {"router, token ids": [], "router, text": [], "decode directly": []}
    for i in range(samples):
        times["router, token ids"].append(first_token_ms(router.Generate(inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=ids), sampling=one))))
        times["router, text"].append(first_token_ms(router.Generate(inference_pb2.GenerateRequest(
            text=TTFT_PROMPT, sampling=one))))
        times["decode directly"].append(first_token_ms(decode.Decode(internal_pb2.DecodeRequest(
            request_id=f"direct-{i}", prefill_locally=True, prompt_token_ids=ids, sampling=one))))
    return times


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        user, system = f.read().rsplit(")", 1)[1].split()[11:13]
    return (int(user) + int(system)) / os.sysconf("SC_CLK_TCK")


def through_the_mesh(streams: list[int], tokens: int, dtype: str, ttft_samples: int,
                     batch_invariant: bool) -> tuple[dict[int, tuple[float, float]], dict[str, list[float]]]:
    """Per stream count, tok/s and the router's CPU µs per token; and the TTFT samples."""
    invariance = () if batch_invariant else ("--no-batch-invariant",)
    with running_mesh("--prefill", "0", "--dtype", dtype, *invariance) as address:
        instances = internal_pb2_grpc.AdminStub(rpc.channel(address)).ListInstances(
            internal_pb2.ListInstancesRequest()).instances
        router = next(i.pid for i in instances if i.role == common_pb2.ROLE_ROUTER)
        request = inference_pb2.GenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(
            max_tokens=tokens, temperature=0.0, ignore_eos=True))
        concurrent_streams(address, request, 1)
        rates = {}
        for n in streams:
            before = cpu_seconds(router)
            rate = concurrent_streams(address, request, n)
            rates[n] = rate, (cpu_seconds(router) - before) / (n * tokens) * 1e6
        return rates, router_ttft(address, ttft_samples)


def concurrent_streams(address: str, request: inference_pb2.GenerateRequest, n: int) -> float:
    """Tokens/s of `n` concurrent streams of `request`, from one asyncio client (as aiperf drives a server): it
    shares this machine's cores with the mesh, and a thread per stream cost the mesh ~6 % at 32 streams."""
    async def run() -> float:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)

            async def one() -> int:
                return sum([len(r.delta.token_ids) async for r in stub.Generate(request, timeout=600)])

            start = time.monotonic()
            total = sum(await asyncio.gather(*(one() for _ in range(n))))
            return total / (time.monotonic() - start)

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ttft-samples", type=int, default=100)
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="1-8 rows through the few-row kernel, in-process and in the mesh")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 2 streams of 16 tokens")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.tokens, args.ttft_samples = [1, 2], 16, 5
    engine = in_process(args.streams, args.tokens, args.dtype, args.batch_invariant)
    mesh, ttft = through_the_mesh(args.streams, args.tokens, args.dtype, args.ttft_samples, args.batch_invariant)
    print("\n| streams | in-process tok/s | mesh tok/s | mesh / in-process | router CPU µs / token |\n"
          "|---|---|---|---|---|")
    for n in args.streams:
        rate, router_us = mesh[n]
        print(f"| {n} | {engine[n]:.1f} | {rate:.1f} | {rate / engine[n]:.2f} | {router_us:.0f} |")
    print(f"\n| one greedy token, {args.ttft_samples} samples | TTFT p50 ms | p90 ms |\n|---|---|---|")
    for name, times in ttft.items():
        ordered = sorted(times)
        print(f"| {name} | {statistics.median(ordered):.2f} | {ordered[int(0.9 * (len(ordered) - 1))]:.2f} |")
    main_us, other_us = matmul_us(), on_another_thread(matmul_us)  # last: torch on a second thread, then none
    print(f"\nfp32 [1, 576] @ [576, 1536], {torch.get_num_threads()} threads: main thread {main_us:.1f} us, "
          f"another thread {other_us:.1f} us")


if __name__ == "__main__":
    main()
