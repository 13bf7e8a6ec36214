"""Benchmarks are numbers, not pass/fail: CI only checks that each still runs (tiny sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
def test_engine_bench_runs():
    proc = subprocess.run([sys.executable, str(BENCH / "engine.py"), "--quick"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| infermesh | bfloat16 |" in proc.stdout and "| transformers | float32 |" in proc.stdout


def test_parallel_bench_runs():
    proc = subprocess.run([sys.executable, str(BENCH / "parallel.py"), "--quick"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| 4096 |" in proc.stdout


@pytest.mark.slow
def test_parallel_engine_bench_runs():
    proc = subprocess.run([sys.executable, str(BENCH / "parallel_engine.py"), "--quick"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| CP=2 (pass_kv) |" in proc.stdout and "| TP=2 |" in proc.stdout and "| 16 |" in proc.stdout


def test_kernel_bench_runs():
    proc = subprocess.run([sys.executable, str(BENCH / "kernels.py"), "--quick"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| paged decode attention |" in proc.stdout and "| MoE combine (top-2) |" in proc.stdout


def test_kvtransfer_bench_runs():
    proc = subprocess.run([sys.executable, str(BENCH / "kvtransfer.py"), "--quick"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| gRPC stream (loopback) |" in proc.stdout and "| torch p2p (gloo pair group) |" in proc.stdout


def test_experts_bench_runs():
    proc = subprocess.run([sys.executable, str(BENCH / "experts.py"), "--quick"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| 1 |" in proc.stdout and "| 16 |" in proc.stdout
