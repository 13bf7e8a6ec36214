"""`make bench`: run every benchmark and write their current tables to bench/RESULTS.md.

    python bench/report.py [--only engine mesh ...] [--quick]

Each benchmark prints markdown tables that hold infermesh's figure next to its peer or floor measured in
the same run; this runs them one after the other and writes one section each, headed by the command that
made it, the date and the machine (CPU model, cores, memory, torch). With `--only`, the other sections of
the file stay as they were. A benchmark that fails leaves its section saying so, with its last error line.
History lives in git: each run replaces the file's sections, it never appends.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"

BENCHMARKS = {  # name -> (what it measures, its command)
    "engine": ("Engine throughput against transformers", ["bench/engine.py"]),
    "decode": ("Decode by batch and context length", ["bench/decode.py"]),
    "attention": ("Attention kernels against torch and a read of the KV", ["bench/attention.py"]),
    "linear": ("Few-row projections against torch and a read of the weights", ["bench/linear.py"]),
    "kvtransfer": ("KV transports against a gloo send and a memcpy", ["bench/kvtransfer.py"]),
    "mesh": ("The mesh against the engine it serves", ["bench/mesh.py"]),
    "push": ("What a KV push adds to the time to first token", ["bench/push.py"]),
    "pool": ("Multi-turn chat with and without the KV pool", ["bench/pool.py"]),
    "serve": ("Colocated against disaggregated under load", ["bench/serve.py", "--plot", "bench/serve.png"]),
}

HEAD = """# Benchmark results

The current tables, written by `make bench` (`bench/report.py`); each section names the command that
made it, its date and its machine, and every figure stands next to its peer or floor measured in the same
run. Shared machines vary by 10-25 % from hour to hour: compare within a table. Earlier results are in
this file's git history.
"""


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {memory:.0f} GiB, torch {torch.__version__}"


def section(name: str, text: str) -> str:
    return f"<!-- {name} -->\n{text.strip()}\n<!-- /{name} -->"


def sections(text: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r"<!-- (\w+) -->\n.*?<!-- /\1 -->", text, re.S)}


def run(name: str, quick: bool, where: str) -> str:
    title, command = BENCHMARKS[name]
    argv = [*command, *(["--quick"] if quick else [])]
    print(f"bench: {' '.join(argv)}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    body = proc.stdout.strip() if proc.returncode == 0 else \
        f"Failed (exit code {proc.returncode}): {(proc.stderr.strip().splitlines() or ['no output'])[-1]}"
    return section(name, f"## {title}\n\n`python {' '.join(argv)}` — {when} — {where}\n\n{body}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    where = machine()
    kept = sections(args.out.read_text()) if args.out.exists() else {}
    for name in args.only:
        kept[name] = run(name, args.quick, where)
        ordered = [kept[n] for n in BENCHMARKS if n in kept]
        args.out.write_text(HEAD + "\n" + "\n\n".join(ordered) + "\n")  # after each: a long run keeps what it has


if __name__ == "__main__":
    main()
