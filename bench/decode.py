"""Decode tokens/s of the in-process engine on SmolLM2 by batch and context length: how attention over
the paged cache grows with the context (the long-context goal of #13 is batch 1 at 6,000 tokens).

    python bench/decode.py [--quick] [--dtype bfloat16] [--quantization none] [--cases 1x6000 8x1000 32x200 1x200]
                           [--no-batch-invariant] [--mesh]

A case BxL runs B sequences whose prompts are L tokens, prefills them, then times `--steps` decode
steps (every sequence has its first token by then). Prints a markdown table. `--mesh` then sends each
batch-1 case's prompt once through `infermesh up`, prefilled on decode and by a CP=2 prefill instance
that pushes the KV to decode (the host's cores split between the instances, the default, and shared),
and reports decode tok/s after the first token (the router's timings).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from bench.up import running_mesh  # noqa: E402
from engine import EngineConfig, EngineCore, SamplingParams  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402
from mesh import rpc  # noqa: E402
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402

CP2 = ("--prefill", "1", "--prefill-cp", "2", "--local-prefill-max-tokens", "0")
MESH_LAYOUTS = {"prefilled on decode": ("--prefill", "0"), "CP=2 prefill -> decode": CP2,
                "the same, cores shared": (*CP2, "--cpus", "shared")}


def prompt(context: int, i: int = 0) -> list[int]:
    return [(7 * j + i) % 40000 + 100 for j in range(context)]


def decode_rate(core: EngineCore, batch: int, context: int, steps: int) -> float:
    greedy = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"{batch}x{context}-{i}", prompt(context, i), greedy)
    while core.scheduler.waiting or any(not s.output_token_ids for s in core.scheduler.running):
        core.step()  # prefill, in chunks
    start = time.perf_counter()
    produced = sum(len(o.new_token_ids) for _ in range(steps) for o in core.step())
    rate = produced / (time.perf_counter() - start)
    while core.has_unfinished():
        core.step()
    return rate


def mesh_rate(flags: tuple[str, ...], dtype: str, context: int, steps: int) -> float:
    """Decode tok/s after the first token of one request with a `context`-token prompt through the mesh."""
    with running_mesh(*flags, "--dtype", dtype) as address:
        stub = inference_pb2_grpc.InferenceStub(rpc.channel(address))
        greedy = common_pb2.SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt(context)), sampling=greedy)
        final = [r.final for r in stub.Generate(request, timeout=900) if r.HasField("final")][0]
        return final.timings.tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none", help="none | int8")
    parser.add_argument("--cases", nargs="+", default=["1x6000", "8x1000", "32x200", "1x200"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="1-8 rows through the few-row kernel (EngineConfig.batch_invariant=False)")
    parser.add_argument("--mesh", action="store_true", help="batch-1 cases through the mesh as well")
    args = parser.parse_args()
    cases = [(2, 64), (1, 300)] if args.quick else [tuple(map(int, c.split("x"))) for c in args.cases]
    steps = 4 if args.quick else args.steps
    core = EngineCore(load_checkpoint("smollm2-135m", getattr(torch, args.dtype)),
                      EngineConfig(dtype=args.dtype, max_num_batched_tokens=2048, quantization=args.quantization,
                                   batch_invariant=args.batch_invariant))
    print(f"\n{args.dtype}, weights {args.quantization}, batch-invariant {args.batch_invariant}, "
          f"{torch.get_num_threads()} threads, "
          f"{steps} decode steps per case\n")
    print("| batch | context | decode tok/s |\n|---|---|---|")
    rates = {}
    for batch, context in cases:
        rates[batch, context] = decode_rate(core, batch, context, steps)
        print(f"| {batch} | {context} | {rates[batch, context]:.1f} |", flush=True)
    core.close()
    if args.mesh:
        print("\n| context | in-process tok/s | " + " | ".join(f"mesh, {name}" for name in MESH_LAYOUTS) + " |\n"
              + "|---" * (2 + len(MESH_LAYOUTS)) + "|")
        for batch, context in cases:
            if batch == 1:
                extra = () if args.batch_invariant else ("--no-batch-invariant",)
                mesh = [mesh_rate((*flags, *extra), args.dtype, context, steps) for flags in MESH_LAYOUTS.values()]
                print(f"| {context} | {rates[1, context]:.1f} | "
                      + " | ".join(f"{r:.1f} ({r / rates[1, context]:.2f})" for r in mesh) + " |", flush=True)


if __name__ == "__main__":
    main()
