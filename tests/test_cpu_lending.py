"""Cores lent between the engine processes of a host (`engine.cpu_lending`): a borrower takes only idle cores,
an owner gets its cores back after the borrower's step in hand and is never starved, a killed owner or
borrower holds nothing, the engine's loop runs a step on borrowed cores with as many more threads, and
`infermesh up` lends a split mesh's prefill cores to a decode instance of one rank."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from engine.core import EngineConfig, EngineCore
from engine.cpu_lending import CpuLending, _try, lock_paths
from engine.cpus import available_cores, format_cpus, share
from engine.loop import EngineLoop
from engine.sampling_params import SamplingParams
from engine.weights import load_checkpoint
from mesh.registry import Role
from mesh.settings import DecodeSettings, load
from mesh.supervisor import MeshSpec, Supervisor
from tests.helpers import wait_until

OWNER, BORROWER = 0, 1  # the cores of the tests' owner (prefill) and borrower (decode)


def wanted(core: int, directory) -> bool:
    """An owner holds the core's `.want`: it works there, or waits to."""
    fd = os.open(lock_paths(core, str(directory))[0], os.O_RDWR)
    try:
        return not _try(fd)
    finally:
        os.close(fd)  # drops the probe's lock with it


def in_thread(fn) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done


HOLDER = """
import sys
from engine.cpu_lending import CpuLending
own, borrowable, directory, act = sys.argv[1:]
lending = CpuLending([int(own)], [int(borrowable)] if borrowable != "-" else [], directory)
print(lending.borrow() if act == "borrow" else lending.work(), flush=True)
sys.stdin.read()  # holds on until killed
"""


def holder(tmp_path, own: int, borrowable: int | None, act: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(own), "-" if borrowable is None else str(borrowable),
                             str(tmp_path), act], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_borrower_takes_idle_cores_and_none_an_owner_works_on(tmp_path):
    owner = CpuLending([OWNER], directory=str(tmp_path))
    borrower = CpuLending([BORROWER], [OWNER, BORROWER], directory=str(tmp_path))
    assert borrower.borrow() == [OWNER]  # not its own core
    borrower.give_back()
    owner.work()
    assert borrower.borrow() == []
    owner.work()  # again: still held, nothing more
    owner.idle()
    assert borrower.borrow() == [OWNER]
    borrower.close()
    owner.close()


def test_an_owner_waits_for_the_borrowers_step_then_keeps_its_cores(tmp_path):
    owner = CpuLending([OWNER], directory=str(tmp_path))
    borrower = CpuLending([BORROWER], [OWNER], directory=str(tmp_path))
    assert borrower.borrow() == [OWNER]
    working = in_thread(owner.work)
    wait_until(lambda: wanted(OWNER, tmp_path))  # it asked for the core ...
    assert not working.wait(0.3)  # ... and waits while the step runs on it
    borrower.give_back()
    assert borrower.borrow() == []  # the next step takes nothing: the waiting owner is not starved
    assert working.wait(30)
    assert borrower.borrow() == []
    owner.idle()
    assert borrower.borrow() == [OWNER]
    borrower.close()
    owner.close()


def test_a_killed_owner_or_borrower_holds_no_core(tmp_path):
    borrower = CpuLending([BORROWER], [OWNER], directory=str(tmp_path))
    proc, _ = holder(tmp_path, OWNER, None, "work")
    assert borrower.borrow() == []
    proc.kill()
    proc.wait(timeout=30)
    assert borrower.borrow() == [OWNER]
    borrower.close()

    owner = CpuLending([OWNER], directory=str(tmp_path))
    proc, took = holder(tmp_path, BORROWER, OWNER, "borrow")
    assert took == f"[{OWNER}]"
    working = in_thread(owner.work)
    assert not working.wait(0.3)  # the borrower's step holds the core
    proc.kill()
    proc.wait(timeout=30)
    assert working.wait(30)
    owner.close()


def test_an_owner_shares_its_core_with_a_hung_borrower_rather_than_wait_for_it(tmp_path):
    proc, took = holder(tmp_path, BORROWER, OWNER, "borrow")  # borrows, then never ends its step
    assert took == f"[{OWNER}]"
    owner = CpuLending([OWNER], directory=str(tmp_path))
    try:
        assert in_thread(lambda: owner.work(wait_s=0.5)).wait(30)  # it goes on working after its wait
        other = CpuLending([BORROWER], [OWNER], directory=str(tmp_path))
        assert other.borrow() == []  # and no borrower takes the core from it meanwhile
        other.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    owner.idle()
    after = CpuLending([BORROWER], [OWNER], directory=str(tmp_path))
    assert after.borrow() == [OWNER]  # nothing held once both are done
    after.close()
    owner.close()


@pytest.mark.skipif(len(available_cores()) < 2, reason="one core: nothing to lend")
def test_the_engine_loop_runs_steps_on_borrowed_cores_while_their_owner_idles(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    engine = EngineCore(load_checkpoint(str(folder)), EngineConfig(dtype="float32", num_kv_blocks=16))
    mine, lent = available_cores()[0], available_cores()[-1]  # real cores: the loop's thread runs on them
    owner = CpuLending([lent], directory=str(tmp_path))
    seen: list[tuple[int, list[int]]] = []  # each step's intra-op threads and cores
    step = engine.step
    engine.step = lambda: (seen.append((torch.get_num_threads(), sorted(os.sched_getaffinity(0)))), step())[1]
    finished = threading.Event()
    loop = EngineLoop(engine, lambda outs: any(o.finish_reason for o in outs) and finished.set(),
                      cpus=CpuLending([mine], [lent], directory=str(tmp_path))).start()
    threads = loop.threads

    def generate(tokens: int) -> list[tuple[int, list[int]]]:
        finished.clear()
        seen.clear()
        loop.call(lambda: engine.add_request(f"r{tokens}", [1, 2, 3], SamplingParams(max_tokens=tokens, temperature=0,
                                                                                     ignore_eos=True)))
        assert finished.wait(60)
        return list(seen)

    try:
        steps = generate(4)  # prompt, then decode steps: on the idle owner's core too, one more thread
        assert steps and all(step == (threads + 1, sorted({mine, lent})) for step in steps)
        assert loop.call(lambda: (torch.get_num_threads(), sorted(os.sched_getaffinity(0)))) == (threads, [mine])
        owner.work()
        borrowed = loop.borrowed_steps
        assert borrowed == len(steps)
        steps = generate(5)
        assert steps and all(step == (threads, [mine]) for step in steps)  # the owner works: own cores only
        assert loop.borrowed_steps == borrowed
        owner.idle()
    finally:
        loop.stop()
    after = CpuLending([mine], [lent], str(tmp_path))
    assert after.borrow() == [lent]  # the stopped loop holds nothing
    after.close()
    owner.close()


@pytest.mark.skipif(len(available_cores()) < 2, reason="one core: nothing to split, nothing to lend")
def test_up_lends_the_prefill_cores_of_a_split_mesh_to_a_decode_instance_of_one_rank(tmp_path):
    decode, prefill = share(available_cores(), [1, 1])
    flags = Supervisor(MeshSpec(prefill=1), log_dir=str(tmp_path))
    flags._cores = flags._plan_cores()
    assert flags._cpus(Role.DECODE, 0) == {"cpus": format_cpus(decode), "borrow_cpus": format_cpus(prefill)}
    assert flags._cpus(Role.PREFILL, 0) == {"cpus": format_cpus(prefill)}  # prefill's chunks never borrow

    tp2 = Supervisor(MeshSpec(prefill=1, decode_tp=2), log_dir=str(tmp_path))
    tp2._cores = tp2._plan_cores()
    assert "borrow_cpus" not in tp2._cpus(Role.DECODE, 0)  # its ranks step together: none borrows alone

    with pytest.raises(ValueError, match="borrow_cpus needs cpus"):
        load(DecodeSettings, {"borrow_cpus": "1"})
    with pytest.raises(ValueError, match=r"only a decode instance of one rank borrows cores \(tp=1\), got tp=2"):
        load(DecodeSettings, {"cpus": "0", "borrow_cpus": "1", "tp": 2})
    with pytest.raises(ValueError, match="cpus='x' is not a core list"):
        load(DecodeSettings, {"cpus": "0", "borrow_cpus": "x"})
