"""engine/heap.py: once an engine process keeps its freed heap, memory it frees and allocates again is the same
memory, still holding what was written to it (so no page is faulted in afresh); without it glibc gives the
pages back and the next allocation gets new, zeroed ones. Seen by content, not by counting page faults, so
transparent huge pages (one fault per 2 MiB) do not change the answer. Each case runs in a process of its own
(the setting is process-wide, and this one's engine tests have set it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

REALLOCATE = """
import ctypes, sys
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
SIZE, MARK = 16 << 20, 0xA5  # a prefill step's activation, in size

def allocate_again():  # whether the block holds what the one freed before it held: the same pages, kept
    p = libc.malloc(SIZE)
    kept = all(ctypes.c_ubyte.from_address(p + offset).value == MARK for offset in (SIZE // 2, SIZE - 4096))
    ctypes.memset(p, MARK, SIZE)
    libc.free(p)
    return kept

print(kept, *(allocate_again() for _ in range(3)))
"""


def reuses(mode: str) -> tuple[str, list[str]]:
    """What `keep_freed_heap` returned (None: not called) and, for three 16 MiB blocks allocated and freed in
    turn, whether each found the one before's contents."""
    out = subprocess.run([sys.executable, "-c", REALLOCATE, mode], check=True, capture_output=True, text=True)
    kept, *found = out.stdout.split()
    return kept, found


def test_memory_freed_and_allocated_again_is_the_same_memory():
    assert reuses("keep") == ("True", ["False", "True", "True"])  # new pages once, then the same ones


def test_by_default_the_second_allocation_gets_new_pages():
    kept, found = reuses("default")
    assert kept == "None" and found[1] == "False", found  # what the setting saves: the check above can fail


@pytest.mark.parametrize("process, arch", [("engine", "llama"), ("experts", "mixtral")])
def test_engine_and_expert_processes_keep_their_freed_heap(tiny_checkpoint, process, arch):
    folder, _ = tiny_checkpoint(arch)
    _, found = reuses(f"{process}:{folder}")
    assert found[1:] == ["True", "True"], found


def test_without_a_c_library_that_has_mallopt_it_changes_nothing(monkeypatch):
    import ctypes

    from engine import heap

    class NoMallopt:  # a C library without the call (as some non-glibc ones)
        def __init__(self, name):
            pass

    monkeypatch.setattr(ctypes, "CDLL", NoMallopt)
    assert heap.keep_freed_heap() is False

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert heap.keep_freed_heap() is False
