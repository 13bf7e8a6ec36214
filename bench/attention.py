"""Attention alone, as a step of SmolLM2 runs it: 30 layers, bf16, 9 query heads over 3 KV heads of 64.

Decode: every sequence on blocks of its own in random order; the C++ kernel (`engine/kernels/cpu_decode.py`)
against torch's way (gather the blocks, then SDPA), and the floor: reading the same KV bytes once (the max of
their 32-bit words: a bf16 sum is arithmetic-bound on some CPUs, 17 GB/s against a read's 29 on the AMX VM).
Prompts: one causal prompt of n tokens; the C++ kernel (`engine/kernels/cpu_prefill.py`) against torch's
SDPA called as the engine calls it where the kernel does not run, with each one's rate of attention FLOPs
(4 n^2 / 2 x head_dim per query head and layer: the causal half of QK^T and PV).

    python bench/attention.py [--quick] [--cases 1x6000 8x1000 32x200 1x200] [--prompts 2048 4096]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine.attention import gather_blocks  # noqa: E402
from engine.kernels.cpu_decode import paged_decode  # noqa: E402
from engine.kernels.cpu_prefill import prefill_attention  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def step_ms(step, runs: int) -> float:
    step()
    start = time.perf_counter()
    for _ in range(runs):
        step()
    return (time.perf_counter() - start) / runs * 1e3


def case(batch: int, context: int, runs: int) -> tuple[float, float, float, float]:
    per = -(-context // BLOCK)
    g = torch.Generator().manual_seed(0)
    caches = [[torch.randn(batch * per, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in "kv"]
              for _ in range(LAYERS)]  # distinct per layer: read from memory, as in the model
    tables = torch.randperm(batch * per, generator=g).view(batch, per)
    lens = torch.full((batch,), context, dtype=torch.int32)
    mask = (torch.arange(per * BLOCK)[None, :] < lens[:, None])[:, None, None, :]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).bfloat16()

    def kernel() -> None:
        for k, v in caches:
            paged_decode(q, k, v, tables, lens, HEAD_DIM**-0.5)

    def gather_sdpa() -> None:
        for k, v in caches:
            kd, vd = (gather_blocks(c, tables).transpose(1, 2) for c in (k, v))  # [B, Hkv, L, D]
            F.scaled_dot_product_attention(q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), kd, vd,
                                           attn_mask=mask, scale=HEAD_DIM**-0.5)

    def read_once() -> None:
        for k, v in caches:
            k.view(torch.int32).max(), v.view(torch.int32).max()

    kv_bytes = LAYERS * 2 * batch * per * BLOCK * KV_HEADS * HEAD_DIM * 2
    return step_ms(kernel, runs), step_ms(gather_sdpa, runs), step_ms(read_once, runs), kv_bytes / 1e9


def prompt_case(tokens: int, runs: int) -> tuple[float, float, float]:
    """(kernel ms, SDPA ms, attention GFLOP) for 30 layers of one causal prompt."""
    g = torch.Generator().manual_seed(0)
    layers = [tuple(torch.randn(tokens, h, HEAD_DIM, generator=g).bfloat16() for h in (HEADS, KV_HEADS, KV_HEADS))
              for _ in range(LAYERS)]

    def kernel() -> None:
        for q, k, v in layers:
            prefill_attention(q, k, v, HEAD_DIM**-0.5, True)

    def sdpa() -> None:
        for q, k, v in layers:
            F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True,
                                           scale=HEAD_DIM**-0.5, enable_gqa=True)

    flop = LAYERS * HEADS * 4 * tokens * tokens / 2 * HEAD_DIM
    return step_ms(kernel, runs), step_ms(sdpa, runs), flop / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--cases", nargs="+", default=["1x6000", "8x1000", "32x200", "1x200"])
    parser.add_argument("--prompts", nargs="+", type=int, default=[2048, 4096])
    args = parser.parse_args()
    cases = [(2, 40)] if args.quick else [tuple(map(int, c.split("x"))) for c in args.cases]
    runs = 1 if args.quick else 10
    print(f"\n{torch.get_num_threads()} threads, ms per step of {LAYERS} layers\n")
    print("| batch | context | KV MB | C++ kernel | gather + SDPA | read once (floor) | kernel GB/s |\n"
          "|---|---|---|---|---|---|---|")
    for batch, context in cases:
        kernel, torch_ms, floor, gb = case(batch, context, runs)
        print(f"| {batch} | {context} | {gb * 1e3:.0f} | {kernel:.2f} | {torch_ms:.2f} | {floor:.2f} | "
              f"{gb / kernel * 1e3:.1f} |", flush=True)
    print(f"\n{torch.get_num_threads()} threads, ms for one causal prompt through {LAYERS} layers\n")
    print("| prompt tokens | C++ kernel | torch SDPA | kernel GFLOP/s | SDPA GFLOP/s |\n|---|---|---|---|---|")
    for tokens in [100] if args.quick else args.prompts:
        kernel, sdpa, gflop = prompt_case(tokens, 1 if args.quick else 3)
        print(f"| {tokens} | {kernel:.0f} | {sdpa:.0f} | {gflop / kernel * 1e3:.0f} | {gflop / sdpa * 1e3:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
