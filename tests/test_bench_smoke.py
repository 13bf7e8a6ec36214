"""Benchmarks are numbers, not pass/fail: CI only checks that each still runs (tiny sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_quick(script: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """Run `bench/<script> --quick [args]` as a user would; fail with its stderr if it fails."""
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_engine_bench_runs():
    proc = run_quick("engine.py", timeout=600)
    assert "| infermesh | bfloat16 |" in proc.stdout and "| transformers | float32 |" in proc.stdout
    assert "| infermesh | bfloat16, int8 weights |" in proc.stdout


def test_int8_matmul_bench_runs():
    proc = run_quick("int8_matmul.py", timeout=300)
    assert "| 17 |" in proc.stdout


def test_parallel_bench_runs():
    proc = run_quick("parallel.py", timeout=300)
    assert "| 4096 |" in proc.stdout


def test_parallel_engine_bench_runs():
    proc = run_quick("parallel_engine.py", timeout=600)
    assert "| CP=2 (pass_kv) |" in proc.stdout and "| TP=2 |" in proc.stdout and "| 16 |" in proc.stdout


def test_kernel_bench_runs():
    proc = run_quick("kernel_throughput.py", timeout=300)
    assert "| paged decode attention |" in proc.stdout and "| MoE combine (top-2) |" in proc.stdout


def test_kvtransfer_bench_runs():
    proc = run_quick("kvtransfer.py", timeout=300)
    assert "| gRPC stream (loopback) |" in proc.stdout and "| torch p2p (gloo pair group) |" in proc.stdout


def test_experts_bench_runs():
    proc = run_quick("experts.py", timeout=300)
    assert "| 1 |" in proc.stdout and "| 16 |" in proc.stdout


def test_attention_bench_runs():
    proc = run_quick("attention.py", timeout=300)
    assert "| 2 | 40 |" in proc.stdout


def test_linear_bench_runs():
    proc = run_quick("linear.py", "--rows", "1", "3", timeout=300)
    assert "| 4 KiB | 3 |" in proc.stdout and "| 2 MiB | 1 |" in proc.stdout


def test_decode_bench_runs():
    proc = run_quick("decode.py", timeout=300)
    assert "| 2 | 64 |" in proc.stdout and "| 1 | 300 |" in proc.stdout


def test_mesh_bench_runs():
    proc = run_quick("mesh.py", timeout=300)
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1 and float(rows[0][4]) >= 0  # 2 streams, and the router CPU per token (in 10 ms ticks)
    assert "| router, token ids |" in proc.stdout and "| decode directly |" in proc.stdout


def test_serve_bench_runs(tmp_path):
    proc = run_quick("serve.py", "--plot", str(tmp_path / "serve.png"), timeout=600)
    assert "| colocated |" in proc.stdout and "| disaggregated |" in proc.stdout
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"


def test_push_bench_runs():
    proc = run_quick("push.py", "--transports", "shared_memory", timeout=600)  # each transport: test_mesh_processes
    assert "| prefilled on decode |" in proc.stdout and "| prefill + decode, shared_memory |" in proc.stdout


def test_gpu_check_runs_and_its_checks_pass_here():
    """bench/gpu_check.py, prepared for a GPU, runs its checks on this CPU (Triton in its interpreter)."""
    proc = run_quick("gpu_check.py", timeout=300)
    assert "| parity: tiny llama, 3 prompts x 12 greedy tokens | ok | 3/3 equal |" in proc.stdout
    assert "| Triton LSE merge, 4 partials | ok |" in proc.stdout and "MISMATCH" not in proc.stdout
