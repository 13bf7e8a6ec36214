"""engine/heap.py: once an engine process keeps its freed heap, memory it frees and allocates again costs no
new page faults; without it glibc gives the pages back and faults them in afresh. Each case runs in a
process of its own (the setting is process-wide, and this one's engine tests have set it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

REALLOCATE = """
import ctypes, resource, sys
from engine.heap import keep_freed_heap
kept = keep_freed_heap() if sys.argv[1] == "keep" else None
if sys.argv[1].startswith("engine:"):  # an engine sets it as it builds its runner
    from engine.llm import LLM
    LLM(sys.argv[1].removeprefix("engine:"), dtype="float32")
if sys.argv[1].startswith("experts:"):  # an expert rank as it takes its experts
    import torch
    from engine.model import build_model
    from engine.parallel.expert_attach import ExpertShard
    from engine.weights import load_checkpoint
    checkpoint = load_checkpoint(sys.argv[1].removeprefix("experts:"), torch.float32)
    ExpertShard(build_model(checkpoint.config, checkpoint.weights, "cpu"), 0, 1)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
SIZE = 16 << 20  # a prefill step's activation, in size

def faults_to_allocate_and_touch():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(p)
    return faults

print(kept, *(faults_to_allocate_and_touch() for _ in range(3)))
"""


def faults(mode: str) -> tuple[str, list[int]]:
    """What `keep_freed_heap` returned (None: not called) and the page faults of three 16 MiB allocations."""
    out = subprocess.run([sys.executable, "-c", REALLOCATE, mode], check=True, capture_output=True, text=True)
    kept, *counts = out.stdout.split()
    return kept, [int(c) for c in counts]


def test_memory_freed_and_allocated_again_is_not_faulted_in_again():
    kept, counts = faults("keep")
    assert kept == "True"
    pages = (16 << 20) // 4096
    assert counts[0] >= pages // 2  # the first time the pages are new
    assert max(counts[1:]) < pages // 20, counts  # then the heap hands the same ones back


def test_by_default_the_second_allocation_faults_its_pages_in_again():
    kept, counts = faults("default")
    assert kept == "None"
    assert counts[1] >= (16 << 20) // 4096 // 2, counts  # what the setting saves: the check above can fail


@pytest.mark.parametrize("process, arch", [("engine", "llama"), ("experts", "mixtral")])
def test_engine_and_expert_processes_keep_their_freed_heap(tiny_checkpoint, process, arch):
    folder, _ = tiny_checkpoint(arch)
    _, counts = faults(f"{process}:{folder}")
    assert max(counts[1:]) < (16 << 20) // 4096 // 20, counts
