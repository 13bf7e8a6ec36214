"""Cores for the engine processes of a host (`engine.cpus`, `engine.threads.pin`): core lists read and
written as Linux writes them, a host's cores shared among instances by their ranks, a process pinned to
its share (every thread, and the intra-op thread count), and bad lists refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.cpus import format_cpus, parse_cpus, share
from engine.threads import pin
from mesh.settings import DecodeSettings, load
from mesh.supervisor import MeshSpec


def test_core_lists_read_and_write_as_linux_writes_them():
    assert parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpus("5, 2-3,3") == [2, 3, 5]
    assert format_cpus([8, 0, 1, 2, 3]) == "0-3,8"
    assert format_cpus([4, 6]) == "4,6"
    for text in ("", "a", "3-1", "-1", "1-2-3"):
        with pytest.raises(ValueError, match=r"cpus=.* is not a core list such as 0-3,8"):
            parse_cpus(text)


def test_share_deals_contiguous_runs_in_proportion_to_the_ranks():
    assert share([0, 1], [1, 2]) == [[0], [1]]  # a decode and a CP=2 prefill on two cores
    assert share(range(8), [1, 1]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert share(range(8), [1, 3]) == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert share(range(4), [1, 2]) == [[0], [1, 2, 3]]  # 1.33 and 2.67: the larger remainder takes the spare
    assert share(range(3), [1, 1]) == [[0, 1], [2]]  # a tie: the earlier part (decode) takes it
    assert share([4, 5, 6, 7], [1, 1, 10]) == [[4], [5], [6, 7]]  # one core each at least, taken from the largest


def test_share_with_more_parts_than_cores_gives_one_core_each_in_turn():
    assert share([0, 1], [1, 2, 2]) == [[0], [1], [0]]
    with pytest.raises(ValueError, match="weights >= 1"):
        share([0, 1], [1, 0])
    with pytest.raises(ValueError, match="need cores"):
        share([], [1])


PINNED = """
import json, os, sys, threading, torch
from engine.threads import pin
started = threading.Event()
before = threading.Thread(target=started.wait)  # a thread that exists when the process is pinned
before.start()
pin([int(sys.argv[1])])
tasks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
child = os.popen(sys.executable + " -c 'import os; print(sorted(os.sched_getaffinity(0)))'").read()
started.set()
print(json.dumps({"tasks": tasks, "threads": torch.get_num_threads(), "child": child.strip()}))
"""


def test_pin_puts_every_thread_and_child_on_the_cores_with_as_many_intra_op_threads():
    core = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PINNED, str(core)], capture_output=True, text=True, timeout=120,
                         check=True)
    seen = json.loads(out.stdout)
    assert len(seen["tasks"]) >= 2 and all(cores == [core] for cores in seen["tasks"].values())
    assert seen["threads"] == 1 and seen["child"] == f"[{core}]"


def test_cores_the_process_may_not_use_are_refused_by_name():
    allowed = format_cpus(sorted(os.sched_getaffinity(0)))
    out = subprocess.run([sys.executable, "-c", "from engine.threads import pin; pin([4095])"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"cpus='4095': this process may use only cores {allowed}" in out.stderr
    core = min(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"cpus='{core}', borrow_cpus='4095': this process may use only cores"):
        pin([core], [4095])  # refused before anything is pinned
    with pytest.raises(ValueError, match="cpus='zero' is not a core list"):
        load(DecodeSettings, {"cpus": "zero"})
    with pytest.raises(ValueError, match="cpus must be split or shared, got 'all'"):
        MeshSpec(cpus="all")
