"""Scheduler: token budget, chunked prefill, admission, preemption (pure Python)."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import FinishReason, Sequence, SequenceStatus

P = SamplingParams(max_tokens=100)


def make(num_blocks=64, block_size=4, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


def seq(i: int, n: int) -> Sequence:
    return Sequence(f"r{i}", list(range(100 * i, 100 * i + n)), P, arrival=i)


def run_step(s: Scheduler) -> list:
    chunks = s.schedule()
    s.update(chunks)
    for c in chunks:
        if c.samples:
            c.seq.token_ids.append(7)  # what sampling would do
    return chunks


def test_decodes_and_prefill_chunks_share_the_budget():
    s = make(max_num_batched_tokens=10)
    a, b = seq(1, 3), seq(2, 25)
    s.add(a)
    run_step(s)  # a prefilled
    s.add(b)
    chunks = run_step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [("r1", 1), ("r2", 9)]
    assert not chunks[1].samples  # b's prompt is not done
    chunks = run_step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [("r1", 1), ("r2", 9)]
    chunks = run_step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [("r1", 1), ("r2", 7)]
    assert chunks[1].samples


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(seq(i, 4))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_newest_running_sequence_is_preempted_when_blocks_run_out():
    s = make(num_blocks=4, block_size=4)
    old, new = seq(1, 8), seq(2, 7)  # 2 blocks each: the cache is full
    s.add(old)
    s.add(new)
    run_step(s)
    assert len(s.running) == 2
    run_step(s)  # old needs a 3rd block for token 9: new is preempted
    assert s.num_preemptions == 1
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert list(s.waiting) == [new]
    assert new.token_ids[-1] == 7  # its generated token is kept and will be recomputed


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    s = make(num_blocks=3, block_size=2)
    old, new = seq(1, 2), seq(2, 2)
    s.add(old)
    s.add(new)
    run_step(s)  # both prefilled, one block each, and each sampled a 3rd token: one block is free
    chunks = run_step(s)  # old takes the free block; new needs one too, and it is the newest: it yields itself
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [("r1", 1)]
    assert s.num_preemptions == 1 and list(s.waiting) == [new] and s.running == [old]
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert len(old.block_table) == 2 and s.blocks.num_free_blocks == 1


def test_finish_frees_blocks():
    s = make(num_blocks=8)
    a = seq(1, 10)
    s.add(a)
    run_step(s)
    s.finish(a, FinishReason.LENGTH)
    assert s.blocks.num_free_blocks == 8 and not s.has_unfinished()
    assert a.finish_reason is FinishReason.LENGTH


def test_admission_reuses_a_cached_prefix():
    s = make(block_size=4)
    a = seq(1, 12)
    s.add(a)
    run_step(s)
    s.finish(a, FinishReason.STOP)
    b = Sequence("again", a.prompt_token_ids + [5, 5], P, arrival=9)
    s.add(b)
    (chunk,) = run_step(s)
    assert b.num_cached_prompt_tokens == 12 and chunk.start == 12 and chunk.num_tokens == 2
