"""Engine throughput on SmolLM2: infermesh (fp32, bf16, bf16 without batch invariance, bf16 with int8 weights,
with and without batch invariance) next to transformers, same run.

    python bench/engine.py [--quick]

Measures decode tokens/s at batch 1, 16 and 32 (the goal: infermesh at 32 against transformers at 16)
and the prefill tokens/s of one 2048-token prompt. Decode rates exclude the prefill: they time steps after
every sequence has its first token. Prints a markdown table and infermesh's ratios to transformers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine import EngineConfig, EngineCore, SamplingParams  # noqa: E402
from engine.model_info import resolve_model  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402

PROMPT_TOKENS = [504, 3575, 282, 4649, 314]  # any short prompt; decode cost barely depends on it


def infermesh_rates(dtype: str, batches: tuple[int, ...], decode_steps: int, prefill_len: int,
                    quantization: str = "none", batch_invariant: bool = True) -> dict[str, float]:
    core = EngineCore(load_checkpoint("smollm2-135m", getattr(torch, dtype)),
                      EngineConfig(dtype=dtype, max_num_batched_tokens=max(2048, prefill_len),
                                   quantization=quantization, batch_invariant=batch_invariant))
    greedy = SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True)
    rates = {}
    for b in batches:
        for i in range(b):
            core.add_request(f"b{b}-{i}", PROMPT_TOKENS + [i % 100], greedy)
        core.step()  # all prefills fit one step
        start = time.perf_counter()
        produced = sum(len(o.new_token_ids) for _ in range(decode_steps) for o in core.step())
        rates[f"decode_b{b}"] = produced / (time.perf_counter() - start)
        while core.has_unfinished():
            core.step()
    prompt = [(7 * i) % 40000 + 100 for i in range(prefill_len)]
    core.add_request("prefill", prompt, SamplingParams(max_tokens=1))
    start = time.perf_counter()
    core.step()
    rates["prefill"] = prefill_len / (time.perf_counter() - start)
    return rates


def transformers_rates(dtype: str, batches: tuple[int, ...], decode_steps: int,
                       prefill_len: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)).eval()
    rates = {}
    with torch.inference_mode():
        for b in batches:
            ids = torch.tensor([PROMPT_TOKENS + [i % 100] for i in range(b)])
            kwargs = dict(do_sample=False, pad_token_id=2, eos_token_id=None)
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            first = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=decode_steps + 1, min_new_tokens=decode_steps + 1, **kwargs)
            rates[f"decode_b{b}"] = b * decode_steps / (time.perf_counter() - start - first)
        prompt = torch.tensor([[(7 * i) % 40000 + 100 for i in range(prefill_len)]])
        start = time.perf_counter()
        model(prompt, logits_to_keep=1)
        rates["prefill"] = prefill_len / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args()
    batches, steps, prefill = ((1, 2, 4), 4, 128) if args.quick else ((1, 16, 32), 32, 2048)
    rows, rates = [], {}
    runs = [("infermesh", "float32", infermesh_rates, {}), ("infermesh", "bfloat16", infermesh_rates, {}),
            ("infermesh", "bfloat16, not batch-invariant", infermesh_rates, {"batch_invariant": False}),
            ("infermesh", "bfloat16, int8 weights", infermesh_rates, {"quantization": "int8"}),
            ("infermesh", "bfloat16, int8 weights, not batch-invariant", infermesh_rates,
             {"quantization": "int8", "batch_invariant": False}),
            ("transformers", "float32", transformers_rates, {}), ("transformers", "bfloat16", transformers_rates, {})]
    for name, label, fn, options in runs:
        r = fn(label.split(",")[0], batches, steps, prefill, **options)
        decode = " | ".join(f"{r[f'decode_b{b}']:.1f}" for b in batches)
        rows.append(f"| {name} | {label} | {decode} | {r['prefill']:.0f} |")
        print(rows[-1], file=sys.stderr, flush=True)
        rates[name, label] = r
    header = (
        f"{torch.get_num_threads()} threads, SmolLM2-135M\n\n"
        f"| engine | dtype | {' | '.join(f'decode b{b} tok/s' for b in batches)} | prefill {prefill} tok/s |\n"
        f"|---|---|{'---|' * len(batches)}---|"
    )
    ours, theirs = rates["infermesh", "bfloat16"], rates["transformers", "float32"]
    big, peer = batches[-1], batches[-2]  # the goal: infermesh at the largest batch against transformers at the next
    ratios = (f"\ninfermesh bfloat16 / transformers float32: decode batch {batches[0]} "
              f"{ours[f'decode_b{batches[0]}'] / theirs[f'decode_b{batches[0]}']:.2f}x, batch {big} against its "
              f"batch {peer} {ours[f'decode_b{big}'] / theirs[f'decode_b{peer}']:.2f}x, prefill "
              f"{ours['prefill'] / theirs['prefill']:.2f}x")
    print(header + "\n" + "\n".join(rows) + "\n" + ratios)


if __name__ == "__main__":
    main()
