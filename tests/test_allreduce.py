"""All-reduce algorithms over real multi-process gloo groups built without a default group."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from engine.parallel import shm_allreduce
from engine.parallel.allreduce import AllReduceAlgorithm, AllReducer, AllReduceThresholds, all_reduce, choose_algorithm
from engine.parallel.groups import rendezvous, stateless_group
from tests.helpers import free_port


def all_algorithms_worker(rank: int, world: int, port: int) -> None:
    store = rendezvous("127.0.0.1", port, rank, world)
    group = stateless_group(store, "tp", rank, world)
    other = stateless_group(store, "second", rank, world)  # two groups coexist in one process
    for numel in (1, 7, 1000, 4099):  # sizes not divisible by the world size pad in the tree path
        # integer-valued floats: every summation order gives exactly the same result
        base = torch.arange(numel, dtype=torch.float32)
        expected = sum(base * (r + 1) for r in range(world))
        for algorithm in AllReduceAlgorithm:
            for g in (group, other):
                t = base * (rank + 1)
                all_reduce(t, g, algorithm)
                assert torch.equal(t, expected), (algorithm, numel)
    t = torch.ones(3, 5) * rank
    all_reduce(t, group)  # chosen by size
    assert torch.equal(t, torch.full((3, 5), float(sum(range(world)))))
    gloo_only = AllReducer(group, AllReduceThresholds(flat_max_bytes=64, tree_max_bytes=1024), shared_memory=False)
    shared = AllReducer(other)  # one CPU host: through shared memory
    assert shared.shared is not None
    for step in range(3):  # the shared segment's two buffer sets alternate
        for numel in (8, 100, 1000, 70_000):  # gloo: flat, tree, ring by size
            expected = torch.arange(numel, dtype=torch.float32) * sum(range(1, world + 1)) + step * world
            for reducer in (gloo_only, shared):
                t = torch.arange(numel, dtype=torch.float32) * (rank + 1) + step
                assert torch.equal(reducer(t), expected)
    big = torch.ones(3 << 20) * rank  # 12 MB: past the shared segment, falls back to gloo
    assert torch.equal(shared(big), torch.full((3 << 20,), float(sum(range(world)))))


def shares_memory_worker(rank: int, world: int, port: int) -> None:
    store = rendezvous("127.0.0.1", port, rank, world)
    group = stateless_group(store, "t", rank, world)
    assert shm_allreduce.shares_memory(group)  # ranks of one host
    assert shm_allreduce.shares_memory(group, b"host-a")
    assert not shm_allreduce.shares_memory(group, b"host-a" if rank == 0 else b"host-b")  # as if on two hosts


def test_ranks_that_do_not_share_dev_shm_are_told_so():
    mp.spawn(shares_memory_worker, args=(2, free_port()), nprocs=2)


@pytest.mark.parametrize("world", [2, 4])
def test_flat_tree_and_ring_give_the_same_sums(world):
    mp.spawn(all_algorithms_worker, args=(world, free_port()), nprocs=world)


def test_algorithm_is_chosen_by_message_size():
    t = AllReduceThresholds(flat_max_bytes=1000, tree_max_bytes=10_000)
    assert choose_algorithm(1000, t) is AllReduceAlgorithm.FLAT
    assert choose_algorithm(1001, t) is AllReduceAlgorithm.TREE
    assert choose_algorithm(10_001, t) is AllReduceAlgorithm.RING
    assert choose_algorithm(200 * 1024) is AllReduceAlgorithm.FLAT  # Meta's default thresholds
    assert choose_algorithm(29 * 1024 * 1024 + 1) is AllReduceAlgorithm.RING


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match=r"flat_max_bytes \(10\) <= tree_max_bytes \(5\)"):
        AllReduceThresholds(flat_max_bytes=10, tree_max_bytes=5)
