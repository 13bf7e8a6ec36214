"""Decode tokens/s of the in-process engine on SmolLM2 by batch and context length: how attention over
the paged cache grows with the context (the long-context goal of #13 is batch 1 at 6,000 tokens).

    python bench/decode.py [--quick] [--dtype bfloat16] [--quantization none] [--cases 1x6000 8x1000 32x200 1x200]

A case BxL runs B sequences whose prompts are L tokens, prefills them, then times `--steps` decode
steps (every sequence has its first token by then). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine import EngineConfig, EngineCore, SamplingParams  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402


def decode_rate(core: EngineCore, batch: int, context: int, steps: int) -> float:
    greedy = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"{batch}x{context}-{i}", [(7 * j + i) % 40000 + 100 for j in range(context)], greedy)
    while core.scheduler.waiting or any(not s.output_token_ids for s in core.scheduler.running):
        core.step()  # prefill, in chunks
    start = time.perf_counter()
    produced = sum(len(o.new_token_ids) for _ in range(steps) for o in core.step())
    rate = produced / (time.perf_counter() - start)
    while core.has_unfinished():
        core.step()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none", help="none | int8")
    parser.add_argument("--cases", nargs="+", default=["1x6000", "8x1000", "32x200", "1x200"])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    cases = [(2, 64), (1, 300)] if args.quick else [tuple(map(int, c.split("x"))) for c in args.cases]
    steps = 4 if args.quick else args.steps
    core = EngineCore(load_checkpoint("smollm2-135m", getattr(torch, args.dtype)),
                      EngineConfig(dtype=args.dtype, max_num_batched_tokens=2048, quantization=args.quantization))
    print(f"\n{args.dtype}, weights {args.quantization}, {torch.get_num_threads()} threads, "
          f"{steps} decode steps per case\n")
    print("| batch | context | decode tok/s |\n|---|---|---|")
    for batch, context in cases:
        print(f"| {batch} | {context} | {decode_rate(core, batch, context, steps):.1f} |", flush=True)
    core.close()


if __name__ == "__main__":
    main()
