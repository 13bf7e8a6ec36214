"""The parallel runtime: layout validation, fail-fast with the failing rank's message, no orphans,
CP's KV equal to one rank's, expert all-to-all with empty splits."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.core import EngineConfig, EngineCore
from engine.kv_cache import KVStripe
from engine.moe import SparseMoE
from engine.parallel.context import ParallelConfig, ParallelContext, connect
from engine.parallel.ep import ExpertParallelMoE, all_to_all, expert_placement
from engine.parallel.groups import rendezvous
from engine.parallel.launcher import ParallelError
from engine.parallel.parallelize import build_runner
from engine.parallel.tp import head_shard
from engine.step_plan import ChunkPlan, StepPlan
from engine.weights import load_checkpoint
from tests.test_allreduce import free_port

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def child_ranks() -> list[int]:
    """pids of this process's children running a follower rank."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"engine.parallel.launcher" in cmdline:
            pids.append(int(entry))
    return pids


def tiny_config(**overrides) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position=512, rms_norm_eps=1e-6, rope_theta=1e4,
                tie_word_embeddings=False)
    return ModelConfig(**(base | overrides))


# ---- layout validation -------------------------------------------------------------------------


def test_layout_that_does_not_fit_the_model_names_every_factor():
    with pytest.raises(ValueError) as e:
        ParallelConfig(tp=5).check(tiny_config())
    assert "tp=5 exceeds num_heads=4" in str(e.value)
    assert "intermediate_size=96 is not divisible by tp=5" in str(e.value)
    assert "world_size=5" in str(e.value)


def test_expert_parallelism_needs_experts():
    with pytest.raises(ValueError, match="ep=2 needs a mixture-of-experts model; llama has no experts"):
        ParallelConfig(ep=2).check(tiny_config())


@pytest.mark.parametrize("sizes,message", [
    (dict(tp=2, cp=2), "tp=2 with cp=2 is not supported"),
    (dict(tp=2, ep=4), "ep=4 must equal tp=2"),
    (dict(cp=2, ep=2), "ep=2 with cp=2 is not supported"),
    (dict(tp=0), "tp must be >= 1, got 0"),
    (dict(cp_method="ring"), "cp_method must be 'auto', 'pass_kv' or 'pass_q', got 'ring'"),
])
def test_unsupported_combinations_are_refused_with_the_sizes(sizes, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**sizes)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    cfg = tiny_config(num_heads=9, num_kv_heads=3, hidden_size=576, head_dim=64)  # SmolLM2's heads
    shards = [head_shard(cfg, 2, r) for r in range(2)]
    assert [s.q_heads for s in shards] == [(0, 4), (4, 9)]
    assert [s.kv_heads for s in shards] == [(0, 2), (1, 3)]  # KV head 1 serves query heads 3, 4 and 5
    assert shards[0].kv_head_map(cfg) == [0, 0, 0, 1]
    assert [head_shard(cfg, 9, r).kv_heads for r in (0, 3, 8)] == [(0, 1), (1, 2), (2, 3)]


# ---- failures --------------------------------------------------------------------------------------


def test_a_rank_that_fails_to_start_fails_the_instance_with_its_message(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    copy = shutil.copytree(folder, tmp_path / "vanishing")
    checkpoint = load_checkpoint(str(copy))
    shutil.rmtree(copy)  # rank 0 has the weights; rank 1 will not find them
    with pytest.raises(ParallelError, match=r"rank 1 failed: .*vanishing"):
        EngineCore(checkpoint, EngineConfig(dtype="float32"), ParallelConfig(tp=2))
    assert child_ranks() == []


def test_a_rank_that_dies_mid_run_fails_the_next_step_fast_and_no_rank_is_left(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="float32", tp=2)
    assert len(child_ranks()) == 1
    llm.generate([[5, 6, 7]], GREEDY)
    os.kill(child_ranks()[0], signal.SIGKILL)
    with pytest.raises(ParallelError, match=f"rank 1 exited with code {-signal.SIGKILL}"):
        llm.generate([[5, 6, 7]], GREEDY)
    assert child_ranks() == []
    with pytest.raises(ParallelError, match="has stopped"):
        llm.generate([[5, 6, 7]], GREEDY)
    llm.close()  # safe after a failure


@pytest.mark.slow
def test_an_instance_idle_longer_than_its_collective_timeout_still_runs_the_next_step(tiny_checkpoint):
    import datetime
    import time

    from engine.parallel.executor import ParallelExecutor

    folder, _ = tiny_checkpoint("llama")
    executor = ParallelExecutor(load_checkpoint(str(folder)), ParallelConfig(tp=2), dtype=torch.float32, device="cpu",
                                block_size=8, num_blocks=4, timeout=datetime.timedelta(seconds=10))
    try:
        plan = StepPlan((ChunkPlan((5, 6, 7), 0, (0,), True),))
        first = executor.execute(plan)
        time.sleep(11)  # the follower waits for the next plan longer than a collective may wait
        assert torch.equal(executor.execute(plan), first)
    finally:
        executor.close()
    assert child_ranks() == []


@pytest.mark.slow
def test_closing_stops_every_rank(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    with LLM(str(folder), dtype="float32", ep=4) as llm:
        assert len(child_ranks()) == 3
        llm.generate([[5, 6, 7]], GREEDY)
    assert child_ranks() == []


# ---- CP: the KV in the cache ------------------------------------------------------------------------


def cp_kv_worker(rank: int, world: int, port: int, folder: str, method: str) -> None:
    torch.set_num_threads(1)
    checkpoint = load_checkpoint(folder)
    block_size, num_blocks = 4, 40
    layout = dict(dtype=torch.float32, device="cpu", block_size=block_size, num_blocks=num_blocks)
    single = build_runner(checkpoint, ParallelContext(config=ParallelConfig(), rank=0), **layout)
    parallel = ParallelConfig(cp=world, cp_method=method)
    cp = build_runner(checkpoint, connect(rendezvous("127.0.0.1", port, rank, world), rank, parallel), **layout)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 300, (60,), generator=g).tolist()
    table = tuple(range(5, 5 + 15))  # 60 tokens in blocks of 4, not starting at block 0
    steps = [
        StepPlan((ChunkPlan(tuple(tokens[:37]), 0, table[:10], True),)),  # full prefill
        StepPlan((ChunkPlan((tokens[37],), 37, table[:10], True),  # a decode row next to a partial prefill
                  ChunkPlan(tuple(tokens[:5]), 0, (30, 31), False))),
        StepPlan((ChunkPlan(tuple(tokens[38:59]), 38, table, True),)),  # partial prefill over a sharded prefix
    ]
    for plan in steps:
        expected, got = single.execute(plan), cp.execute(plan)
        if rank == 0:  # the rank that samples
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)  # [global block, offset]
    for plan in steps:
        for c in plan.chunks:
            for p in range(c.start, c.end):
                written[c.block_table[p // block_size], p % block_size] = True
    assert cp.kv_stripe == KVStripe(rank, world)
    mine = [g for g in range(num_blocks) if g % world == rank and written[g].any()]  # written blocks of its stripe
    assert mine
    for (k1, v1), (kc, vc) in zip(single.kv_cache, cp.kv_cache):
        for g in mine:  # global block g is this rank's block g // world
            torch.testing.assert_close(kc[g // world][written[g]], k1[g][written[g]], atol=1e-5, rtol=0)
            torch.testing.assert_close(vc[g // world][written[g]], v1[g][written[g]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("world,method", [(2, "pass_kv"), (3, "pass_q"), (2, "auto")])
def test_cp_prefill_stores_the_same_kv_as_one_rank(world, method, tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    mp.spawn(cp_kv_worker, args=(world, free_port(), str(folder), method), nprocs=world)


# ---- EP: dispatch and combine -----------------------------------------------------------------------


def ep_worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    ctx = connect(rendezvous("127.0.0.1", port, rank, world), rank, ParallelConfig(ep=world))
    group = ctx.ep_group
    # uneven splits, some empty: rank r sends r rows to every rank
    rows = torch.full((rank * world, 3), float(rank))  # rank 0 sends nothing at all
    received = all_to_all(group, rows, [rank] * world, list(range(world)))
    assert torch.equal(received[:, 0], torch.tensor([float(r) for r in range(world) for _ in range(r)]))
    torch.manual_seed(0)
    moe = SparseMoE(hidden=16, intermediate=8, num_experts=8, top_k=2, renormalize=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    placement = expert_placement(8, world)
    ep = ExpertParallelMoE(moe, placement, group)
    for num_tokens in (1, 3, 17):  # one token: every rank but one dispatches nothing
        x = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(num_tokens))
        torch.testing.assert_close(ep(x), moe(x), atol=1e-5, rtol=0)
    counts = ep.tokens_per_expert.clone()
    total = torch.tensor([int(counts.sum())])
    group.allreduce([total]).wait()
    assert int(total) == (1 + 3 + 17) * 2  # every (token, choice) computed once, somewhere


@pytest.mark.parametrize("world", [2, 4])
def test_expert_dispatch_and_combine_equal_local_experts(world):
    mp.spawn(ep_worker, args=(world, free_port()), nprocs=world)


def test_expert_placement_is_contiguous_and_balanced():
    assert expert_placement(8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert expert_placement(5, 2) == (0, 0, 1, 1, 1)
    with pytest.raises(ValueError, match=r"ep must be in \[1, num_experts=4\], got 5"):
        expert_placement(4, 5)
