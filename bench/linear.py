"""The linear layers of a small-batch decode step alone: SmolLM2's 120 projection weights (30 layers of qkv,
o, gate_up, down; 212 MB of bf16, read from memory as in the model), multiplied by M rows each. torch's way
(`mv` for one row, `F.linear` for more) against the few-row C++ kernel (engine/kernels/cpu_linear.cpp:
AMX tiles or AVX512-BF16 dot products where the CPU has them, else float32 FMAs; up to 64 rows, 8 in
float32), with the weights in 4 KiB pages and in huge pages (engine/huge_pages.py), and the floor: reading
the same bytes once (an int32 max over each weight).

    python bench/linear.py [--quick] [--rows 1 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine.huge_pages import huge_page_bytes  # noqa: E402
from engine.kernels.cpu_ops import ops  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in]: qkv, o, gate_up, down


def weights(layers: int, huge: bool) -> list[torch.Tensor]:
    shapes = SHAPES * layers
    total = sum(o * i for o, i in shapes)
    memory = huge_page_bytes(total * 2) if huge else None
    flat = memory.view(torch.bfloat16) if memory is not None else torch.empty(total, dtype=torch.bfloat16)
    flat.normal_()
    out, at = [], 0
    for o, i in shapes:
        out.append(flat[at:at + o * i].view(o, i))
        at += o * i
    return out


def ms(step, runs: int) -> float:
    step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(runs):
            step()
        best = min(best, (time.perf_counter() - start) / runs * 1e3)
    return best


def torch_way(ws: list[torch.Tensor], xs: dict[int, torch.Tensor], m: int) -> None:
    for w in ws:
        x = xs[w.shape[1]][:m]
        torch.mv(w, x[0]) if m == 1 else F.linear(x, w)


def few_row_kernel(ws: list[torch.Tensor], xs: dict[int, torch.Tensor], m: int) -> None:
    for w in ws:
        ops().linear(xs[w.shape[1]][:m], w)


def read_once(ws: list[torch.Tensor]) -> None:
    for w in ws:
        w.view(torch.int32).max()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64])
    args = parser.parse_args()
    layers, runs = (2, 1) if args.quick else (30, 10)
    kernel_rows = ops().linear_rows(torch.bfloat16)
    print(f"\nthe kernel takes up to {kernel_rows} rows in bf16 on this CPU")
    print(f"{torch.get_num_threads()} threads, ms for {layers * len(SHAPES)} weights "
          f"({sum(o * i for o, i in SHAPES) * layers * 2 / 1e6:.0f} MB), best of 3\n")
    print("| pages | rows | torch | few-row kernel | read once (floor) |\n|---|---|---|---|---|")
    for huge in (False, True):
        ws = weights(layers, huge)
        xs = {i: torch.randn(max(args.rows), i, dtype=torch.bfloat16) for i in {i for _, i in SHAPES}}
        floor = ms(lambda: read_once(ws), runs)  # noqa: B023 - timed before the next pass
        for m in args.rows:
            theirs = ms(lambda: torch_way(ws, xs, m), runs)  # noqa: B023
            mine = f"{ms(lambda: few_row_kernel(ws, xs, m), runs):.2f}" if m <= kernel_rows else "-"  # noqa: B023
            print(f"| {'2 MiB' if huge else '4 KiB'} | {m} | {theirs:.2f} | {mine} | {floor:.2f} |", flush=True)


if __name__ == "__main__":
    main()
