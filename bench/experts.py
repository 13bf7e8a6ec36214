"""Attached experts: one MoE layer whose experts live on an expert instance's ranks, on this machine.

    python bench/experts.py [--quick]

One attention rank and two expert ranks (one process and one thread each) share an attachment group,
as a prefill or decode instance and an expert instance do. For 1, 16 and 256 tokens: the time of the
layer as the attention rank sees it (gate and top-k, counts, rows out, experts compute, rows back,
combine; 8 experts top-2, D = I = 1024, fp32), next to two bare `all_to_all_single` calls moving the
same rows out and back on the same group (the physical floor here) and the layer with every expert on
the attention rank itself. Prints markdown for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine.moe import SparseMoE  # noqa: E402
from engine.parallel.ep import ExpertExchange, all_to_all, expert_placement  # noqa: E402
from engine.parallel.expert_attach import AttachedMoE, experts_per_rank  # noqa: E402
from engine.parallel.groups import stateless_group  # noqa: E402

HIDDEN, EXPERTS, TOP_K, EXPERT_RANKS = 1024, 8, 2, 2


def worker(rank: int, port: int, token_counts: list[int], repeats: int, results) -> None:
    torch.set_num_threads(1)
    world = 1 + EXPERT_RANKS
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    group = stateless_group(store, "attach-bench", rank, world)
    torch.manual_seed(0)
    moe = SparseMoE(hidden=HIDDEN, intermediate=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, renormalize=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    counts = experts_per_rank(EXPERTS, 1, EXPERT_RANKS)
    with torch.inference_mode():
        if rank == 0:
            attached = AttachedMoE(moe, group, attention_ranks=1)
        else:
            mine = [e for e, owner in enumerate(expert_placement(EXPERTS, EXPERT_RANKS)) if owner == rank - 1]
            exchange = ExpertExchange(group, counts, moe.w_gate_up[mine[0]:mine[-1] + 1].clone(),
                                      moe.w_down[mine[0]:mine[-1] + 1].clone())
            none, no_weights = torch.empty(0, HIDDEN), torch.empty(0, TOP_K)
            no_ids = torch.empty(0, TOP_K, dtype=torch.long)
        for tokens in token_counts:
            rows = tokens * TOP_K  # the attention rank's rows out, and back
            out_splits = [0, rows // 2, rows - rows // 2]
            layer, floor, local = [], [], []
            x, payload = torch.randn(tokens, HIDDEN), torch.randn(rows, HIDDEN)
            for _ in range(repeats):
                group.barrier().wait()
                start = time.perf_counter()
                if rank == 0:
                    attached(x)
                else:
                    exchange.run(none, no_weights, no_ids)
                layer.append(time.perf_counter() - start)
                group.barrier().wait()
                start = time.perf_counter()
                if rank == 0:
                    all_to_all(group, payload, out_splits, [0, 0, 0])
                    all_to_all(group, payload[:0], [0, 0, 0], out_splits)
                else:
                    arrived = all_to_all(group, payload[:0], [0, 0, 0], [out_splits[rank], 0, 0])
                    all_to_all(group, arrived, [out_splits[rank], 0, 0], [0, 0, 0])
                floor.append(time.perf_counter() - start)
                if rank == 0:
                    start = time.perf_counter()
                    moe(x)  # every expert on this rank
                    local.append(time.perf_counter() - start)
            if rank == 0:
                results.put((tokens, *(statistics.median(t) * 1e3 for t in (layer, floor, local))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 16 tokens, 2 repeats (the CI smoke run)")
    args = parser.parse_args()
    token_counts, repeats = ([1, 16], 2) if args.quick else ([1, 16, 256], 20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(port, token_counts, repeats, results), nprocs=1 + EXPERT_RANKS)
    print(f"### Attached experts: 1 attention rank + {EXPERT_RANKS} expert ranks x 1 thread, {EXPERTS} experts "
          f"top-{TOP_K}, D = I = {HIDDEN}, fp32, median ms\n")
    print("| tokens | attached: gate + dispatch + experts + combine | two bare all-to-alls of the rows | "
          "one rank, all experts |")
    print("|---|---|---|---|")
    while not results.empty():
        tokens, layer, floor, local = results.get()
        print(f"| {tokens} | {layer:.2f} | {floor:.2f} | {local:.2f} |")
    print()


if __name__ == "__main__":
    main()
