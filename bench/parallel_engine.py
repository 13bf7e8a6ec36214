"""Parallel engine speed on this machine, one thread per rank, SmolLM2 in bfloat16.

    python bench/parallel_engine.py [--prompt-tokens 4096] [--batch 16] [--only cp|tp|ep] [--quick]

- CP prefill: time to first token of one long prompt at CP=1 (one thread, then
  the whole machine), CP=2 and CP=4 (one thread per rank; CP=4 oversubscribes
  two cores); parallel efficiency = T(CP=1, 1 thread) / (threads · T) (the paper:
  93% on H100s); the prompt's KV each rank stores; and, with every rank's cache
  capped below the prompt's KV, CP=1 refusing the prompt and CP=2 serving it.
- TP decode: tokens/s at batch 16, TP=2 vs TP=1.
- EP: dispatch + compute + combine time of one MoE layer (8 experts, top-2,
  D = I = 1024) over 2 ranks for 1, 16 and 256 tokens, next to one bare
  `all_to_all_single` of the same payload (the floor).
Prints markdown for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine import LLM, SamplingParams  # noqa: E402
from engine.block_manager import prefix_hashes  # noqa: E402
from engine.kv_cache import bytes_per_block  # noqa: E402
from engine.moe import SparseMoE  # noqa: E402
from engine.parallel.context import ParallelConfig, connect  # noqa: E402
from engine.parallel.ep import ExpertParallelMoE, all_to_all, expert_placement  # noqa: E402
from engine.parallel.groups import rendezvous  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402


def ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - start


def prompt_blocks_per_rank(llm: LLM, prompt: list[int]) -> list[int]:
    """How many of the prompt's (cached, full) KV blocks each rank stores."""
    blocks = llm.engine.blocks
    ids = [blocks.cached[h] for h in prefix_hashes(prompt, blocks.block_size) if h in blocks.cached]
    return [sum(1 for b in ids if b % blocks.pools == rank) for rank in range(blocks.pools)]


def bench_cp(prompt_tokens: int) -> None:
    prompt = [(i * 7919) % 40000 + 100 for i in range(prompt_tokens)]
    options = dict(dtype="bfloat16", max_num_batched_tokens=prompt_tokens)
    block_mb = bytes_per_block(load_checkpoint("smollm2-135m").config, 16, torch.bfloat16) / 1e6
    rows, one = [], None
    for cp, threads in ((1, 1), (1, 2), (2, 1), (4, 1)):
        torch.set_num_threads(threads)
        with LLM("smollm2-135m", cp=cp, **options) as llm:
            ttft(llm, [7] * 256)
            seconds = min(ttft(llm, p) for p in (prompt, prompt[::-1]))
            per_rank = prompt_blocks_per_rank(llm, prompt)
            methods = ", ".join(sorted(m.value for m in llm.engine.executor.runner.choices)) if cp > 1 else ""
        one = one or seconds
        kv = " / ".join(f"{n * block_mb:.1f}" for n in per_rank)
        label = f"CP={cp} ({methods})" if methods else f"CP={cp}"
        rows.append(f"| {label} | {threads} | {seconds:.2f} | {prompt_tokens / seconds:.0f} "
                    f"| {one / (cp * threads * seconds):.0%} | {kv} |")
    torch.set_num_threads(1)
    cap = int(0.6 * prompt_tokens / 16)  # blocks per rank: 60 % of the prompt's KV
    capped = {}
    for cp in (1, 2):
        with LLM("smollm2-135m", cp=cp, num_kv_blocks=cap, **options) as llm:
            try:
                capped[cp] = f"served, TTFT {ttft(llm, prompt):.2f} s, prompt KV per rank " + " / ".join(
                    f"{n * block_mb:.1f}" for n in prompt_blocks_per_rank(llm, prompt)) + " MB"
            except ValueError as e:
                capped[cp] = f"refused: {e}"
    print(f"### CP prefill, SmolLM2 bf16, {prompt_tokens} tokens, on this machine's 2 cores\n")
    print("| layout | threads per rank | TTFT s | prefill tok/s | efficiency vs CP=1 x 1 thread "
          "| the prompt's KV per rank, MB |\n|---|---|---|---|---|---|")
    print("\n".join(rows) + "\n")
    print(f"Each rank's cache capped at {cap} blocks ({cap * block_mb:.0f} MB, 60 % of the prompt's KV):\n")
    for cp, outcome in capped.items():
        print(f"- CP={cp}: {outcome}")
    print()


def decode_rate(llm: LLM, batch: int, steps: int) -> float:
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(batch)]
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outs = llm.generate(prompts, params)
    return statistics.median(o.tokens_per_s for o in outs) * batch


def bench_tp(batch: int, steps: int) -> None:
    torch.set_num_threads(1)
    single = decode_rate(LLM("smollm2-135m", dtype="bfloat16"), batch, steps)
    with LLM("smollm2-135m", dtype="bfloat16", tp=2) as llm:
        two = decode_rate(llm, batch, steps)
    print(f"### TP decode, SmolLM2 bf16, batch {batch}, 1 thread per rank\n")
    print("| layout | decode tok/s | speedup |\n|---|---|---|")
    print(f"| TP=1 | {single:.0f} | — |\n| TP=2 | {two:.0f} | {two / single:.2f}x |\n")


def ep_worker(rank: int, world: int, port: int, token_counts: list[int], results) -> None:
    torch.set_num_threads(1)
    group = connect(rendezvous("127.0.0.1", port, rank, world), rank, ParallelConfig(ep=world)).ep_group
    torch.manual_seed(0)
    moe = SparseMoE(hidden=1024, intermediate=1024, num_experts=8, top_k=2, renormalize=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ep = ExpertParallelMoE(moe, expert_placement(8, world), group)
    with torch.inference_mode():
        for tokens in token_counts:
            x = torch.randn(tokens, 1024)
            layer, floor, local = [], [], []
            share = -(-tokens // world) * 2  # rows this rank sends: its share of tokens x top-2
            splits = [share // world] * (world - 1) + [share - share // world * (world - 1)]
            payload = torch.randn(share, 1024)
            for _ in range(20 if len(token_counts) > 2 else 2):
                group.barrier().wait()
                start = time.perf_counter()
                ep(x)
                layer.append(time.perf_counter() - start)
                group.barrier().wait()
                start = time.perf_counter()
                back = all_to_all(group, payload, splits, splits)  # dispatch-sized, then combine-sized
                all_to_all(group, back, splits, splits)
                floor.append(time.perf_counter() - start)
                start = time.perf_counter()
                moe(x)  # the same layer with all experts on this rank
                local.append(time.perf_counter() - start)
            if rank == 0:
                results.put((tokens, *(statistics.median(t) * 1e3 for t in (layer, floor, local))))


def bench_ep(token_counts: list[int]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(ep_worker, args=(2, port, token_counts, results), nprocs=2)
    print("### EP MoE layer, 2 ranks x 1 thread, 8 experts top-2, D = I = 1024, fp32, median ms\n")
    print("| tokens | EP=2: dispatch + experts + combine | two bare all-to-alls of the payload "
          "| one rank, all experts |")
    print("|---|---|---|---|")
    while not results.empty():
        tokens, layer, floor, local = results.get()
        print(f"| {tokens} | {layer:.2f} | {floor:.2f} | {local:.2f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--only", choices=["cp", "tp", "ep"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args()
    if args.only in (None, "cp"):
        bench_cp(256 if args.quick else args.prompt_tokens)
    if args.only in (None, "tp"):
        bench_tp(2 if args.quick else args.batch, 4 if args.quick else 32)
    if args.only in (None, "ep"):
        bench_ep([1, 16] if args.quick else [1, 16, 256])


if __name__ == "__main__":
    main()
