"""The prepared GPU check: one script, one table, for the day a GPU machine is lent.

    python bench/gpu_check.py                  # on a CUDA GPU (about 5 minutes on one H100)
    python bench/gpu_check.py --quick          # anywhere: tiny sizes, Triton under TRITON_INTERPRET=1 on CPU

Each row is a check against a reference we did not write, or a figure next to its peer or floor on the same
device in the same run:

- engine parity: greedy tokens of the engine equal transformers' on the same device, float32 (TF32 off), on
  tiny random llama and qwen3_moe checkpoints and on SmolLM2-135M;
- the Triton kernels compiled for the device against torch references: paged decode attention (and its GB/s
  against the device's own copy bandwidth), the LSE merge, MoE permute and combine;
- decode and prefill tokens/s of the engine against transformers' on the same device and model;
- the mooncake KV transport writing from GPU memory (tests/test_mooncake.py's CUDA test), where a GPU and
  Mooncake's CUDA build are present.

It stops at --timeout-s with what it has, and exits 1 on a mismatch (2 on a timeout).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run on CPU through the interpreter
sys.path[0] = str(ROOT)  # repo root, not bench/: no script here shadows a package

from bench.kernel_throughput import timed  # noqa: E402
from engine import LLM, EngineConfig, EngineCore, SamplingParams  # noqa: E402
from engine.kernels.lse_merge import merge_lse  # noqa: E402
from engine.kernels.moe_permute import combine_rows, permute_rows  # noqa: E402
from engine.kernels.paged_decode import paged_decode_attention  # noqa: E402
from engine.model_info import resolve_model  # noqa: E402
from engine.parallel.cp_merge import merge_partials, partial_attention  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402


@dataclass
class Row:
    check: str
    ok: bool | None  # None: a figure, not a check
    figure: str = ""
    peer: str = ""

    def line(self) -> str:
        verdict = {True: "ok", False: "MISMATCH", None: ""}[self.ok]
        return f"| {self.check} | {verdict} | {self.figure} | {self.peer} |"


def tiny_checkpoint(arch: str, folder: Path) -> Path:
    """A random tiny checkpoint of `arch`, saved by transformers with a tokenizer (tests/conftest.py's)."""
    from tests.conftest import tiny_hf_model, write_tiny_tokenizer

    path = folder / arch
    tiny_hf_model(arch).save_pretrained(path)
    write_tiny_tokenizer(path)
    return path


def parity(name: str, ours: LLM, theirs, prompts: list[list[int]], steps: int, device: str) -> Row:
    greedy = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in ours.generate(prompts, greedy)]
    want = []
    with torch.inference_mode():
        for prompt in prompts:
            out = theirs.generate(torch.tensor([prompt], device=device), max_new_tokens=steps, min_new_tokens=steps,
                                  do_sample=False, pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    same = sum(a == b for a, b in zip(got, want))
    return Row(f"parity: {name}, {len(prompts)} prompts x {steps} greedy tokens", same == len(prompts),
               f"{same}/{len(prompts)} equal", "transformers, float32, same device")


def parity_checks(device: str, quick: bool, folder: Path) -> list[Row]:
    from transformers import AutoModelForCausalLM

    rows = []
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 37, 90)]
    for arch in ("llama", "qwen3_moe"):
        path = tiny_checkpoint(arch, folder)
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        rows.append(parity(f"tiny {arch}", LLM(str(path), dtype="float32", device=device), theirs, prompts, 12,
                           device))
    if not quick:
        gguf = resolve_model("smollm2-135m")
        theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32).to(device).eval()
        ours = LLM("smollm2-135m", dtype="float32", device=device)
        chat = ours.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        rows.append(parity("SmolLM2-135M", ours, theirs, [chat, prompts[1], prompts[2]], 32, device))
    return rows


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write): the floor a memory-bound kernel is held to."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), 10)


def kernel_checks(device: str, quick: bool) -> list[Row]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch, context, heads, kv_heads, head_dim, block = (2, 64, 4, 2, 64, 16) if quick else (32, 4096, 32, 8, 128, 16)
    g = torch.Generator(device=device).manual_seed(0)
    blocks = context // block
    k_cache = torch.randn(batch * blocks, block, kv_heads, head_dim, device=device, generator=g).to(dtype)
    v_cache = torch.randn(batch * blocks, block, kv_heads, head_dim, device=device, generator=g).to(dtype)
    tables = torch.randperm(batch * blocks, device=device, generator=g).view(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    lens[0] = context - block // 2 - 1  # a partial last block
    q = torch.randn(batch, heads, head_dim, device=device, generator=g).to(dtype)
    scale = head_dim ** -0.5
    out, lse = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    ref = []
    for b in range(batch):  # each sequence's keys gathered from its blocks, exact attention
        n = int(lens[b])
        rows = tables[b, : -(-n // block)].long()
        o, _ = partial_attention(q[b:b + 1].float(), k_cache[rows].flatten(0, 1)[:n].float(),
                                 v_cache[rows].flatten(0, 1)[:n].float(), None, scale)
        ref.append(o[0])
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    decode_ok = torch.allclose(out.float(), torch.stack(ref), atol=tolerance, rtol=tolerance)
    seconds = timed(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale), 3 if quick else 20)
    kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * k_cache.element_size()
    floor = copy_bandwidth(device, 1 << 22 if quick else 1 << 30)
    rows = [Row(f"Triton paged decode attention, batch {batch} x {context} tokens, {str(dtype)[6:]}", decode_ok,
                f"{kv_bytes / seconds / 1e9:.1f} GB/s of KV", f"device copy {floor / 1e9:.1f} GB/s "
                                                              f"({kv_bytes / seconds / floor:.2f} of it)")]

    partials = torch.randn(4, 64, 8, head_dim, device=device, generator=g)
    lses = torch.randn(4, 64, 8, device=device, generator=g)
    lses[1, 3] = float("-inf")  # a partial that saw no key
    merged, merged_lse = merge_lse(partials, lses)
    want, want_lse = merge_partials(partials.cpu(), lses.cpu())  # the torch merge, on the CPU
    rows.append(Row("Triton LSE merge, 4 partials", torch.allclose(merged.cpu(), want, atol=1e-5, rtol=1e-5)
                    and torch.allclose(merged_lse.cpu(), want_lse, atol=1e-5, rtol=1e-5), "", "torch merge"))

    tokens, top_k, dim = (7, 2, 200) if quick else (4096, 8, 4096)
    x = torch.randn(tokens, dim, device=device, generator=g).to(dtype)
    ids = torch.randint(0, 64, (tokens, top_k), device=device, generator=g)
    order = torch.argsort(ids.flatten(), stable=True)
    permuted_ok = torch.equal(permute_rows(x, order // top_k), x[order // top_k])
    y = torch.randn(tokens * top_k, dim, device=device, generator=g).to(dtype)
    weights = torch.rand(tokens, top_k, device=device, generator=g)
    slots = torch.empty_like(order)
    slots[order] = torch.arange(len(order), device=device)
    slots = slots.view(tokens, top_k)
    expected = (y[slots].float() * weights[..., None]).sum(1).to(dtype)
    combined_ok = torch.allclose(combine_rows(y, slots, weights).float(), expected.float(), atol=1e-2, rtol=1e-2)
    rows.append(Row(f"Triton MoE permute + combine, {tokens} tokens x top-{top_k}", permuted_ok and combined_ok,
                    "", "torch indexing"))
    return rows


def throughput_rows(device: str, quick: bool, folder: Path) -> list[Row]:
    """Decode tokens/s at one batch and prefill tokens/s of one prompt: the engine, then transformers."""
    from transformers import AutoModelForCausalLM

    batch, steps, prefill = (4, 8, 64) if quick else (32, 64, 2048)
    model = str(folder / "llama") if quick else "smollm2-135m"
    dtype = torch.float32 if quick else torch.bfloat16
    prompt = [(7 * i) % 250 + 3 for i in range(prefill)]
    core = EngineCore(load_checkpoint(model, dtype), EngineConfig(dtype=str(dtype).removeprefix("torch."),
                                                                  device=device, max_num_batched_tokens=max(2048,
                                                                                                            prefill)))
    greedy = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"d{i}", [5, 6, 7, 8 + i], greedy)
    core.step()  # every prefill
    start = time.perf_counter()
    produced = sum(len(o.new_token_ids) for _ in range(steps) for o in core.step())
    ours_decode = produced / (time.perf_counter() - start)
    while core.has_unfinished():
        core.step()
    core.add_request("p", prompt, SamplingParams(max_tokens=1))
    start = time.perf_counter()
    core.step()
    ours_prefill = prefill / (time.perf_counter() - start)

    if quick:
        theirs = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    else:
        gguf = resolve_model(model)
        theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).to(device).eval()
    ids = torch.tensor([[5, 6, 7, 8 + i] for i in range(batch)], device=device)
    options = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        first = timed(lambda: theirs.generate(ids, max_new_tokens=1, min_new_tokens=1, **options), 1)
        whole = timed(lambda: theirs.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **options), 1)
        theirs_decode = batch * steps / max(whole - first, 1e-9)
        theirs_prefill = prefill / timed(lambda: theirs(torch.tensor([prompt], device=device), logits_to_keep=1), 2)
    name = "tiny llama" if quick else "SmolLM2-135M"
    return [Row(f"decode tokens/s, {name}, batch {batch}, {str(dtype).removeprefix('torch.')}", None,
                f"{ours_decode:.0f}", f"transformers {theirs_decode:.0f} ({ours_decode / theirs_decode:.2f}x)"),
            Row(f"prefill tokens/s, {name}, {prefill} tokens", None, f"{ours_prefill:.0f}",
                f"transformers {theirs_prefill:.0f} ({ours_prefill / theirs_prefill:.2f}x)")]


def mooncake_row(device: str) -> list[Row]:
    if device != "cuda":
        return [Row("mooncake transport from GPU memory", None, "not run: no CUDA device")]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_mooncake.py", "-k", "cuda"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return [Row("mooncake transport from GPU memory (tests/test_mooncake.py -k cuda)",
                done.returncode == 0 and "skipped" not in last, last)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, no SmolLM2: a smoke run anywhere")
    parser.add_argument("--timeout-s", type=int, default=540, help="stop here with what has run")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 parity is exact-ish
    rows: list[Row] = []

    def out_of_time(*_):
        raise TimeoutError

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(args.timeout_s)
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    timed_out = False
    with tempfile.TemporaryDirectory() as folder:
        try:
            for section in (lambda: parity_checks(device, args.quick, Path(folder)),
                            lambda: kernel_checks(device, args.quick),
                            lambda: throughput_rows(device, args.quick, Path(folder)),
                            lambda: mooncake_row(device)):
                for row in section():
                    rows.append(row)
                    print(row.line(), file=sys.stderr, flush=True)
        except TimeoutError:
            timed_out = True
        finally:
            signal.alarm(0)
    print(f"{name}, torch {torch.__version__}\n\n| check | result | figure | peer or floor |\n|---|---|---|---|")
    print("\n".join(row.line() for row in rows))
    if timed_out:
        print(f"\nstopped after {args.timeout_s} s: the checks below the last row did not run")
        sys.exit(2)
    sys.exit(1 if any(row.ok is False for row in rows) else 0)


if __name__ == "__main__":
    main()
