"""Multi-turn chat with and without the KV pool: several conversations (a fixed seed), interleaved turn by
turn; each turn's prompt is the conversation so far (the earlier prompts and answers) and a new message.
Through `infermesh up --prefill 2 --decode 1 --local-prefill-max-tokens 0 --cpus shared` with KV caches
too small to hold every conversation (so instances evict histories they will be asked for again), once
with `--kv-pool mooncake` and once without, on the same trace:

    python bench/pool.py [--conversations 6] [--turns 4] [--kv-cache-mb 48] [--quick]

Prints TTFT p50 and p99 over every turn after the first of each conversation, and the prompt tokens the
engine instances computed (`infermesh_prompt_tokens_computed_total`, summed), per layout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # repo root, not bench/: no script here shadows a package

from bench.up import running_mesh  # noqa: E402
from mesh import rpc  # noqa: E402
from mesh.metrics import scrape  # noqa: E402
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402

VOCAB = 49152  # SmolLM2's


def turn(stub, prompt: list[int], reply_tokens: int) -> tuple[float, list[int]]:
    """TTFT and the answer's tokens."""
    params = common_pb2.SamplingParams(max_tokens=reply_tokens, temperature=0.0, ignore_eos=True)
    start, first, answer = time.perf_counter(), None, []
    for response in stub.Generate(inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt),
                                                                 sampling=params), timeout=600):
        if response.HasField("delta") and response.delta.token_ids:
            first = first or time.perf_counter() - start
            answer += response.delta.token_ids
    return first, answer


def computed(address: str) -> int:
    status = subprocess.run([str(Path(sys.executable).parent / "infermesh"), "status", "--target", address,
                             "--json"], capture_output=True, text=True, check=True)
    return sum(int(scrape(i["metrics_url"]).get(("infermesh_prompt_tokens_computed_total", ()), 0))
               for i in json.loads(status.stdout)["instances"] if i["role"] in ("prefill", "decode"))


def run(flags: list[str], conversations: int, turns: int, first_tokens: int, message_tokens: int,
        reply_tokens: int) -> tuple[list[float], int]:
    rng = random.Random(0)
    histories = [[rng.randrange(100, VOCAB) for _ in range(first_tokens)] for _ in range(conversations)]
    ttfts = []
    with running_mesh(*flags) as address:
        stub = inference_pb2_grpc.InferenceStub(rpc.channel(address))
        for t in range(turns):
            for c in range(conversations):  # interleaved: every conversation's turn t, then turn t + 1
                if t:
                    histories[c] += [rng.randrange(100, VOCAB) for _ in range(message_tokens)]
                seconds, answer = turn(stub, histories[c], reply_tokens)
                histories[c] += answer
                if t:
                    ttfts.append(seconds)
        return ttfts, computed(address)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--kv-cache-mb", type=int, default=48)  # ~2,000 SmolLM2 tokens in bf16 per instance
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args()
    conversations, turns, first, message, reply = (2, 2, 64, 32, 4) if args.quick else \
        (args.conversations, args.turns, 512, 128, 16)
    base = ["--prefill", "2", "--decode", "1", "--local-prefill-max-tokens", "0", "--cpus", "shared",
            "--kv-cache-bytes", str(args.kv_cache_mb << 20)]
    layouts = {"no pool": base, "pool (--kv-pool mooncake)": base + ["--kv-pool", "mooncake", "--kv-pool-memory",
                                                                      "1 GB"]}
    print(f"\n{conversations} conversations x {turns} turns, interleaved: {first}-token first prompts, "
          f"{message}-token messages, {reply}-token answers; {args.kv_cache_mb} MB of KV cache per instance; "
          f"2 prefill + 1 decode instances, bfloat16\n")
    print("| layout | TTFT p50 s (turns 2+) | TTFT p99 s | prompt tokens computed |\n|---|---|---|---|")
    for name, flags in layouts.items():
        ttfts, tokens = run(flags, conversations, turns, first, message, reply)
        ttfts.sort()
        p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
        print(f"| {name} | {statistics.median(ttfts):.3f} | {p99:.3f} | {tokens} |", flush=True)


if __name__ == "__main__":
    main()
