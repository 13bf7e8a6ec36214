"""All-reduce latency per algorithm (flat, tree, ring over gloo; flat through shared memory) across sizes.

    python bench/parallel.py [--world 2] [--quick]

Each rank runs one thread (torch.set_num_threads(1)); the crossover sizes are what
AllReduceThresholds should be on this machine. Prints a markdown table (median
microseconds per all-reduce of float32 messages).
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

from engine.parallel.allreduce import AllReduceAlgorithm, all_reduce  # noqa: E402
from engine.parallel.groups import rendezvous, stateless_group  # noqa: E402
from engine.parallel.shm_allreduce import SharedMemoryAllReduce  # noqa: E402

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 32 << 20]


def worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, results) -> None:
    torch.set_num_threads(1)
    group = stateless_group(rendezvous("127.0.0.1", port, rank, world), "bench", rank, world)
    shared = SharedMemoryAllReduce(group, max_bytes=max(sizes))
    for size in sizes:
        t = torch.ones(size // 4)
        runs = {algorithm.value: lambda a=algorithm, t=t: all_reduce(t, group, a) for algorithm in AllReduceAlgorithm}
        runs["shm flat"] = lambda t=t: shared(t)
        for name, run in runs.items():
            times = []
            for _ in range(repeats):
                group.barrier().wait()
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            if rank == 0:
                results.put((size, name, statistics.median(times) * 1e6))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes, repeats = (SIZES[:2], 3) if args.quick else (SIZES, 10)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args.world, port, sizes, repeats, results), nprocs=args.world)
    table: dict[int, dict[str, float]] = {}
    while not results.empty():
        size, name, us = results.get()
        table.setdefault(size, {})[name] = us
    print(f"### all-reduce, {args.world} ranks x 1 thread, median µs (flat/tree/ring over gloo)\n")
    print("| bytes | flat | tree | ring | shm flat | fastest |\n|---|---|---|---|---|---|")
    for size in sorted(table):
        row = table[size]
        print(f"| {size} | {row['flat']:.0f} | {row['tree']:.0f} | {row['ring']:.0f} | {row['shm flat']:.0f} "
              f"| {min(row, key=row.get)} |")


if __name__ == "__main__":
    main()
