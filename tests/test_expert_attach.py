"""MoE experts on other processes: an attention engine (one rank, TP=2 or CP=2) attached to expert ranks
in one gloo group. Greedy tokens equal transformers, also when most expert ranks receive no tokens in a step
(four ranks of one expert each, top-2, one token a step: every layer computed exactly two rows a step)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from engine.parallel.context import ExpertAttachment
from tests.conftest import TINY_VOCAB
from tests.test_allreduce import free_port
from tests.test_parity_tiny import hf_greedy

STEPS = 8
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def expert_rank(rank: int, folder: str, address: str, attention_ranks: int, expert_ranks: int, results, done) -> None:
    """One expert rank: its experts of every MoE layer, serving the attachment until the test is done."""
    import threading

    from engine.model import build_model
    from engine.parallel.expert_attach import ExpertShard, serve_attachment
    from engine.parallel.groups import stateless_group
    from engine.weights import load_checkpoint

    torch.set_num_threads(1)
    checkpoint = load_checkpoint(folder, torch.float32)
    shard = ExpertShard(build_model(checkpoint.config, checkpoint.weights, "cpu"), rank, expert_ranks)
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
    group = stateless_group(store, "attach-1", attention_ranks + rank, attention_ranks + expert_ranks)
    counts = torch.zeros(len(shard.weights), len(shard.weights[0][0]), dtype=torch.long)
    threading.Thread(target=serve_attachment, args=(shard, group, attention_ranks, counts), daemon=True).start()
    done.wait()
    results.put((rank, counts.tolist()))
    results.close()
    results.join_thread()  # delivered before leaving
    os._exit(0)  # the attention side is gone or idle: leave without a collective


@pytest.mark.parametrize("arch,layout,expert_ranks", [
    ("mixtral", {}, 2), ("qwen3_moe", {}, 2), ("mixtral", {}, 4), ("qwen3_moe", {"tp": 2}, 2),
    ("mixtral", {"cp": 2}, 2)])
def test_attached_experts_give_the_transformers_tokens(tiny_checkpoint, arch, layout, expert_ranks):
    folder, hf = tiny_checkpoint(arch)
    attention_ranks = layout.get("tp", 1) * layout.get("cp", 1)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=expert_rank, args=(r, str(folder), address, attention_ranks, expert_ranks,
                                                     results, done)) for r in range(expert_ranks)]
    for w in workers:
        w.start()
    g = torch.Generator().manual_seed(2)
    lengths = (1,) if expert_ranks == 4 else (1, 9, 40)  # 4 ranks: one token a step, so most ranks get none
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]
    try:
        with LLM(str(folder), dtype="float32", experts=ExpertAttachment(address=address, group="attach-1",
                                                                         expert_ranks=expert_ranks), **layout) as llm:
            outs = llm.generate(prompts, GREEDY)
    finally:
        done.set()
        counts = dict(results.get(timeout=60) for _ in workers)  # a worker that died fails the test, not hangs it
        for w in workers:
            w.join(timeout=30)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, STEPS)[0]
    per_rank = {r: sum(map(sum, c)) for r, c in counts.items()}
    assert all(n > 0 for n in per_rank.values())  # every expert rank computed rows
    if expert_ranks == 4:  # one expert per rank, top-2, one token a step: two rows a step, so two ranks had none
        layers = len(counts[0])
        assert [sum(counts[r][layer][0] for r in counts) for layer in range(layers)] == [2 * STEPS] * layers
