"""Triton kernel throughput: paged decode attention, LSE merge, MoE permute/combine.

    python bench/kernel_throughput.py          # on a CUDA GPU: GB/s against the GPU's memory bandwidth
    python bench/kernel_throughput.py --quick  # anywhere, tiny sizes (on CPU under TRITON_INTERPRET=1: it runs)

GB/s counts the bytes each kernel must move at least once (KV read for decode,
partials read + result written for the merge, rows read + written for permute),
divided by the median time. The peer is the torch path the engine uses on CPU
(SDPA over gathered blocks; indexing), timed on the same device in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine.kernels.lse_merge import merge_lse  # noqa: E402
from engine.kernels.moe_permute import combine_rows, permute_rows  # noqa: E402
from engine.kernels.paged_decode import paged_decode_attention  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = (2, 64, 4, 2, 64, 16) if args.quick else (32, 4096, 32, 8, 128, 16)
    batch, context, heads, kv_heads, head_dim, block = shape
    repeats = 2 if args.quick else 20
    blocks_per_seq = context // block
    k_cache = torch.randn(batch * blocks_per_seq, block, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    scale = head_dim**-0.5

    def torch_decode():
        k = k_cache[tables.long()].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache[tables.long()].flatten(1, 2).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    rows = [("paged decode attention", kv_bytes,
             lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale), torch_decode)]
    partials, tokens = 4, (64 if args.quick else 8192)
    outs = torch.randn(partials, tokens, heads, head_dim, device=device)
    lses = torch.randn(partials, tokens, heads, device=device)
    merge_bytes = (outs.numel() + lses.numel() + tokens * heads * (head_dim + 1)) * 4
    rows.append(("LSE merge (4 partials)", merge_bytes, lambda: merge_lse(outs, lses), None))
    x = torch.randn(tokens, 1024 if not args.quick else 64, device=device, dtype=dtype)
    order = torch.randperm(tokens * 2, device=device) // 2
    permute_bytes = 2 * len(order) * x.shape[1] * x.element_size()
    rows.append(("MoE permute (top-2)", permute_bytes, lambda: permute_rows(x, order), lambda: x[order]))
    y = torch.randn(tokens * 2, x.shape[1], device=device, dtype=dtype)
    slots = torch.randperm(tokens * 2, device=device).view(tokens, 2)
    weights = torch.rand(tokens, 2, device=device)
    combine_bytes = (y.numel() + x.numel()) * x.element_size()
    rows.append(("MoE combine (top-2)", combine_bytes, lambda: combine_rows(y, slots, weights),
                 lambda: (y[slots].float() * weights[..., None]).sum(1).to(dtype)))
    where = torch.cuda.get_device_name() if cuda else "CPU via TRITON_INTERPRET=1 (correctness only, not speed)"
    print(f"### Triton kernels on {where}\n")
    print("| kernel | bytes | Triton µs | GB/s | torch µs |\n|---|---|---|---|---|")
    for name, num_bytes, kernel, peer in rows:
        t = timed(kernel, repeats)
        peer_us = f"{timed(peer, repeats) * 1e6:.0f}" if peer else "—"
        print(f"| {name} | {num_bytes} | {t * 1e6:.0f} | {num_bytes / t / 1e9:.1f} | {peer_us} |")


if __name__ == "__main__":
    main()
