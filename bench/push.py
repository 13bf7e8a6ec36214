"""What pushing a prompt's KV adds to its time to first token: one request at a time, each a distinct
2,048-token prompt (no prefix hits), one token out, through `infermesh up` started per layout:

    prefilled on decode      --prefill 0: no KV moves
    prefill + decode, T      --prefill 1 --local-prefill-max-tokens 0 --kv-transport T --cpus shared,
                             for each transport

    python bench/push.py [--prompt-tokens 2048] [--requests 10] [--transports ...] [--quick]

With one request in flight and the cores shared (not split between the instances), the prefill instance
has them all while it computes, as decode does in the first layout, so the TTFT difference is the
disaggregated path's own cost: reserve, the push (layer by layer, overlapped with the prefill), the join
and the extra hops. Prints TTFT p50 per layout and the ratio to the first.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # repo root, not bench/: no script here shadows a package

from bench.up import running_mesh  # noqa: E402
from mesh import rpc  # noqa: E402
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402

VOCAB = 49152  # SmolLM2's
TRANSPORTS = ("grpc_stream", "torch_p2p", "shared_memory", "mooncake")


def ttft_s(stub, prompt: list[int]) -> float:
    one = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for response in stub.Generate(inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt),
                                                                 sampling=one), timeout=600):
        if response.HasField("delta") and response.delta.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def layout_ttfts(args: list[str], prompts: list[list[int]], dtype: str) -> list[float]:
    with running_mesh("--dtype", dtype, *args) as address:
        stub = inference_pb2_grpc.InferenceStub(rpc.channel(address))
        ttft_s(stub, prompts[0])  # warm-up: first allocations, first connections
        return [ttft_s(stub, p) for p in prompts[1:]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=10)  # five read 1.05-1.16 for the same layout in one hour
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args()
    tokens, requests = (128, 2) if args.quick else (args.prompt_tokens, args.requests)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, VOCAB) for _ in range(tokens)] for _ in range(requests + 1)]
    layouts = {"prefilled on decode": ["--prefill", "0"]}
    for transport in args.transports:
        layouts[f"prefill + decode, {transport}"] = ["--prefill", "1", "--local-prefill-max-tokens", "0",
                                                     "--kv-transport", transport, "--cpus", "shared"]
    print(f"\n{tokens}-token prompts, one at a time, {requests} timed each, {args.dtype}\n")
    print("| layout | TTFT p50 s | min s | / prefilled on decode |\n|---|---|---|---|")
    base = None
    for name, flags in layouts.items():
        times = layout_ttfts(flags, prompts, args.dtype)
        p50 = statistics.median(times)
        base = base or p50
        print(f"| {name} | {p50:.3f} | {min(times):.3f} | {p50 / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
