"""Decode attention alone, as a step of SmolLM2 runs it: 30 layers of bf16 caches (9 query heads, 3 KV heads
of 64), every sequence on blocks of its own in random order. The C++ kernel (`engine/kernels/cpu_decode.py`)
against torch's way (gather the blocks, then SDPA), and the floor: reading the same KV bytes once (a sum).

    python bench/attention.py [--quick] [--cases 1x6000 8x1000 32x200 1x200]
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
            k.sum(), v.sum()

    kv_bytes = LAYERS * 2 * batch * per * BLOCK * KV_HEADS * HEAD_DIM * 2
    return step_ms(kernel, runs), step_ms(gather_sdpa, runs), step_ms(read_once, runs), kv_bytes / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--cases", nargs="+", default=["1x6000", "8x1000", "32x200", "1x200"])
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


if __name__ == "__main__":
    main()
