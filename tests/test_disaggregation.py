"""Disaggregated prefill and decode inside one process: a prefill engine pushes each prompt's KV layer by
layer into blocks a decode engine reserved; the decode engine continues. Tokens equal one engine's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core import EngineConfig, EngineCore
from engine.errors import KVCacheFull, NoReservation, PeerFailed
from engine.weights import load_checkpoint
from tests.conftest import TINY_VOCAB
from tests.helpers import wait_until

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class CopyIntoReservedBlocks:
    """A KV sink that writes straight into the decode engine's cache (what a transport does, minus the wire)."""

    def __init__(self, decode: EngineCore, request_id: str, block_size: int) -> None:
        self.decode, self.request_id, self.block_size = decode, request_id, block_size
        self.layers_pushed = []

    def push_layer(self, layer, k_cache, v_cache, block_table, stripe):  # one rank: stores every block
        dst_table = self.decode._sequences[self.request_id].block_table
        bs = self.block_size
        first = self.decode._sequences[self.request_id].num_cached_prompt_tokens
        n = len(self.decode._sequences[self.request_id].prompt_token_ids)
        src = [block_table[p // bs] * bs + p % bs for p in range(first, n)]
        dst = [dst_table[p // bs] * bs + p % bs for p in range(first, n)]
        dk, dv = self.decode.kv_cache[layer]
        dk.view(-1, *dk.shape[2:])[dst] = k_cache.view(-1, *k_cache.shape[2:])[src]
        dv.view(-1, *dv.shape[2:])[dst] = v_cache.view(-1, *v_cache.shape[2:])[src]
        self.layers_pushed.append(layer)


def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 17, 40)]


@pytest.fixture
def engines(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    config = EngineConfig(dtype="float32", block_size=8, num_kv_blocks=64)
    checkpoint = load_checkpoint(str(folder))
    return EngineCore(checkpoint, config), EngineCore(checkpoint, config), LLM(str(folder), dtype="float32")


def run_to_end(engine: EngineCore, first_outputs) -> dict[str, list[int]]:
    tokens = {o.request_id: list(o.new_token_ids) for o in first_outputs}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_prefill_pushes_kv_layer_by_layer_and_decode_continues_exactly(engines):
    prefill, decode, reference = engines
    expected = [o.token_ids for o in reference.generate(prompts(), GREEDY)]
    sinks, firsts = {}, []
    for i, prompt in enumerate(prompts()):
        rid = f"r{i}"
        decode.reserve(rid, prompt, GREEDY)
        sinks[rid] = CopyIntoReservedBlocks(decode, rid, 8)
        prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_sink=sinks[rid])
    while prefill.has_unfinished():
        for out in prefill.step():
            firsts.append(decode.join(out.request_id, out.new_token_ids[0]))
    assert all(s.layers_pushed == [0, 1] for s in sinks.values())
    assert prefill.blocks.num_used_blocks == 0  # the prefill side keeps nothing
    tokens = run_to_end(decode, firsts)
    assert [tokens[f"r{i}"] for i in range(3)] == expected
    assert decode.blocks.num_used_blocks == 0


def test_seeded_sampling_continues_as_in_one_engine(engines):
    prefill, decode, reference = engines
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=3, ignore_eos=True)
    prompt = prompts()[2]
    (expected,) = reference.generate([prompt], params)
    decode.reserve("s", prompt, params)
    prefill.add_request("s", prompt, dataclasses.replace(params, max_tokens=1),
                        kv_sink=CopyIntoReservedBlocks(decode, "s", 8))
    (first,) = next(out for out in iter(prefill.step, None) if out)
    tokens = run_to_end(decode, [decode.join("s", first.new_token_ids[0])])
    assert tokens["s"] == expected.token_ids


def test_a_failed_transfer_is_recomputed_on_decode(engines):
    _, decode, reference = engines
    prompt = prompts()[1]
    decode.reserve("r", prompt, GREEDY)
    decode.recompute("r")  # nothing arrived
    assert run_to_end(decode, [])["r"] == reference.generate([prompt], GREEDY)[0].token_ids


def test_reserving_more_than_the_cache_holds_is_refused_and_leaks_nothing(engines):
    _, decode, _ = engines
    decode.reserve("holder", [4] * 400, GREEDY)  # 50 of the 64 blocks
    with pytest.raises(KVCacheFull, match=r"KV cache has 14 free blocks; the prompt needs 15"):
        decode.reserve("big", [5] * 120, GREEDY)
    assert decode.blocks.num_used_blocks == 50
    decode.reserve("r", [5] * 20, GREEDY)
    assert decode.abort("r") and decode.abort("holder")
    assert decode.blocks.num_used_blocks == 0  # cancelling a reservation frees it
    with pytest.raises(NoReservation, match="has no reservation"):
        decode.join("r", 7)


def test_an_engine_step_that_raises_stops_the_loop_and_fails_its_waiters(engines):
    from engine.loop import EngineLoop

    _, decode, _ = engines
    failures = []
    loop = EngineLoop(decode, on_outputs=lambda outs: None, on_failure=failures.append).start()
    loop.call(lambda: decode.add_request("r", [5, 6, 7], GREEDY))

    def broken_step():
        raise RuntimeError("device lost")

    decode.step = broken_step  # a fault inside the step, e.g. a kernel error
    loop.call(lambda: None)  # wakes the loop, which then steps
    loop._thread.join(timeout=10)
    assert [str(e) for e in failures] == ["device lost"]
    with pytest.raises(PeerFailed, match="the engine failed: RuntimeError\\('device lost'\\)"):
        loop.call(lambda: None)
    loop.stop()  # safe after a failure


def test_the_loop_moves_into_another_thread_between_steps_and_stops_there(engines):
    """`run_here` (a service's main thread takes the loop): work in flight goes on, on the new thread; `stop()`
    from elsewhere returns once that thread has stopped it; a loop stopped before the move is not run."""
    import threading

    from engine.loop import EngineLoop

    _, decode, reference = engines
    tokens, threads = [], set()

    def on_outputs(outputs) -> None:
        tokens.extend(t for out in outputs for t in out.new_token_ids)
        threads.add(threading.current_thread().name)

    prompt = prompts()[1]
    loop = EngineLoop(decode, on_outputs=on_outputs, name="first").start()
    loop.call(lambda: decode.add_request("r", prompt, GREEDY))
    taker = threading.Thread(target=loop.run_here, name="taker")
    taker.start()
    assert loop.call(lambda: threading.current_thread().name) == "taker"
    wait_until(lambda: not loop.call(decode.has_unfinished))
    assert tokens == reference.generate([prompt], GREEDY)[0].token_ids and "taker" in threads
    loop.stop()
    taker.join(timeout=10)
    assert not taker.is_alive()

    stopped = EngineLoop(decode, on_outputs=on_outputs).start()
    stopped.stop()
    stopped.run_here()  # returns at once: nothing left to run
