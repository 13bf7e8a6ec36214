"""infermesh next to llama.cpp on the same SmolLM2 GGUF, in one run, when asked (not in CI, not in `make bench`).

    python bench/peers.py --install      # once: builds llama-cpp-python into .peers-venv (~11 min on 2 cores)
    python bench/peers.py [--quick]

llama.cpp (through `llama-cpp-python`, in its own virtual environment: it builds from source and is no
dependency of ours) runs the bundled GGUF as shipped, Q4_1 weights, on every core; infermesh dequantizes
the same file to bf16, and to int8 weights with `quantization="int8"`. Measured one after the other:
- batch-1 decode tokens/s: llama.cpp times `eval` of one token after a 6-token prompt (logits computed,
  no sampling); infermesh times engine steps of one greedy sequence (sampling included);
- batch-32 decode tokens/s: llama.cpp decodes one token of each of 32 sequences per `llama_decode` (its
  batched API, what `llama-server` runs for 32 streams; logits computed, no sampling); infermesh times
  engine steps of 32 greedy sequences;
- prefill tokens/s of one 2,048-token prompt.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # repo root, not bench/: no script here shadows a package

from bench.engine import infermesh_rates  # noqa: E402
from engine.model_info import resolve_model  # noqa: E402

PEERS_VENV = ROOT / ".peers-venv"
LLAMA_CPP = "llama-cpp-python==0.3.36"
# Built for the AVX-512 this CPU has but without ggml's AMX kernels: with -march=native they are compiled in
# and segfault on the 2-core VMs here (ggml_backend_amx_mul_mat, the first eval).
AVX512_OPTIONS = {"avx512f": "GGML_AVX512", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def cmake_args(cpu_flags: set[str]) -> str:
    """ggml's build options for a CPU with these flags (/proc/cpuinfo): AVX2 and FMA, the AVX-512 it has, no AMX."""
    avx512 = " ".join(f"-D{option}={'ON' if flag in cpu_flags else 'OFF'}" for flag, option in AVX512_OPTIONS.items())
    return ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON " + avx512 +
            " -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")


def cpu_flags() -> set[str]:
    return set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split())

LLAMA_CPP_RATES = """
import json, os, sys, time
import llama_cpp as L
from llama_cpp import Llama
path, steps, prefill, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
PROMPT = [504, 3575, 282, 4649, 314]
llm = Llama(model_path=path, n_ctx=max(512, prefill + 8), n_batch=prefill, n_threads=os.cpu_count(), verbose=False)
llm.eval(PROMPT + [28])
start = time.perf_counter()
for _ in range(steps):
    llm.eval([28])
rates = {"decode_b1": steps / (time.perf_counter() - start)}
llm.reset()
start = time.perf_counter()
llm.eval([(7 * i) % 40000 + 100 for i in range(prefill)])
rates["prefill"] = prefill / (time.perf_counter() - start)

params = L.llama_context_default_params()  # `batch` sequences side by side, as llama-server holds its slots
params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = batch * 256, 512, 512, batch
params.n_threads = params.n_threads_batch = os.cpu_count()
ctx = L.llama_init_from_model(llm.model, params)
tokens = L.llama_batch_init(512, 0, 1)

def decode(entries):  # (token, position, sequence, logits wanted) each
    tokens.n_tokens = len(entries)
    for i, (token, position, sequence, logits) in enumerate(entries):
        tokens.token[i], tokens.pos[i], tokens.n_seq_id[i], tokens.logits[i] = token, position, 1, logits
        tokens.seq_id[i][0] = sequence
    assert L.llama_decode(ctx, tokens) == 0

decode([(t, p, s, p == len(PROMPT)) for s in range(batch) for p, t in enumerate(PROMPT + [s % 100])])
start = time.perf_counter()
for step in range(steps):
    decode([(28, len(PROMPT) + 1 + step, s, True) for s in range(batch)])
L.llama_synchronize(ctx)
rates[f"decode_b{batch}"] = batch * steps / (time.perf_counter() - start)
print(json.dumps(rates))
"""


def install() -> None:
    subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    subprocess.run([str(PEERS_VENV / "bin" / "pip"), "install", LLAMA_CPP], check=True,
                   env=os.environ | {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count()),
                                    "CMAKE_ARGS": cmake_args(cpu_flags())})


def llama_cpp_rates(python: str, steps: int, prefill: int, batch: int) -> dict[str, float]:
    out = subprocess.run([python, "-c", LLAMA_CPP_RATES, str(resolve_model("smollm2-135m")), str(steps), str(prefill),
                          str(batch)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--install", action="store_true", help=f"build {LLAMA_CPP} into {PEERS_VENV.name}")
    parser.add_argument("--python", default=str(PEERS_VENV / "bin" / "python"), help="a python with llama_cpp")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args()
    if args.install:
        install()
        return
    steps, prefill, batch = (4, 128, 4) if args.quick else (64, 2048, 32)
    rows = [("llama.cpp (llama-cpp-python)", "Q4_1 as shipped", llama_cpp_rates(args.python, steps, prefill, batch))]
    for label, quantization in (("bfloat16", "none"), ("int8 weights, bf16 activations", "int8")):
        r = infermesh_rates("bfloat16", (1, batch), steps, prefill, quantization=quantization)
        rows.append(("infermesh engine", label, r))
    print(f"\n{os.cpu_count()} cores, {steps} decode steps\n")
    print(f"| engine | weights | decode b1 tok/s | decode b{batch} tok/s | prefill {prefill} tok/s |\n"
          "|---|---|---|---|---|")
    for name, weights, r in rows:
        print(f"| {name} | {weights} | {r['decode_b1']:.1f} | {r[f'decode_b{batch}']:.1f} | {r['prefill']:.0f} |")


if __name__ == "__main__":
    main()
