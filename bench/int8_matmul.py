"""The projections of one SmolLM2 decode step (30 layers of qkv, o, gate_up, down, and the LM head; every
weight a distinct tensor, so each is read from memory as in the model) by rows in the batch: bf16 weights
(torch's `F.linear`, and infermesh's few-row kernel `linear`), int8 weights through infermesh's int8 kernel
(`linear_int8`, up to `linear_int8_rows` rows: 64 on AVX512-BF16, else 16; what the engine runs; and not
batch-invariant, AMX tiles from 2 rows where the CPU has them), through torch's int8 kernel, and converted to bf16
per call (what the engine runs past the kernel's rows).

    python bench/int8_matmul.py [--quick] [--rows 1 4 8 16 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine.kernels.cpu_ops import ops  # noqa: E402
from engine.quantize import quantize_rows  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # [out, in]


def step_ms(rows: int, kind: str, weights: list, runs: int = 6) -> float:
    inputs = {d: torch.randn(rows, d, dtype=torch.bfloat16) for d in (576, 1536)}

    def step() -> None:
        for (_, d), (w16, w8, scale) in zip(SHAPES, weights):
            x = inputs[d]
            if kind == "bf16":
                F.linear(x, w16)
            elif kind == "bf16, infermesh kernel":
                ops().linear(x, w16)
            elif kind == "int8, infermesh kernel":
                ops().linear_int8(x, w8, scale)
            elif kind == "int8, not batch-invariant":
                ops().linear_int8(x, w8, scale, False)
            elif kind == "int8, torch kernel":
                torch.ops.aten._weight_int8pack_mm(x, w8, scale)
            else:
                F.linear(x, w8.to(torch.bfloat16)) * scale

    step()
    start = time.perf_counter()
    for _ in range(runs):
        step()
    return (time.perf_counter() - start) / runs * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    rows_list = [1, 17] if args.quick else args.rows
    weights = []
    for out, d in SHAPES:
        w = torch.randn(out, d)
        w8, scale = quantize_rows(w)
        weights.append((w.bfloat16(), w8, scale.bfloat16()))
    kinds = ("bf16", "bf16, infermesh kernel", "int8, infermesh kernel", "int8, not batch-invariant",
             "int8, torch kernel", "int8 converted")
    kernel_rows = {"bf16, infermesh kernel": ops().linear_rows(torch.bfloat16),
                   "int8, infermesh kernel": ops().linear_int8_rows(torch.bfloat16),
                   "int8, not batch-invariant": ops().linear_int8_rows(torch.bfloat16)}
    print(f"\n{torch.get_num_threads()} threads, ms per step of {len(SHAPES)} projections\n")
    print("| rows | " + " | ".join(kinds) + " |\n" + "|---" * (len(kinds) + 1) + "|")
    for rows in rows_list:
        times = [f"{step_ms(rows, k, weights):.1f}" if rows <= kernel_rows.get(k, rows) else "-" for k in kinds]
        print(f"| {rows} | " + " | ".join(times) + " |", flush=True)


if __name__ == "__main__":
    main()
