"""Threads other than the engine's run torch ops on themselves alone (`engine.threads`): a helper that sets
only the calling thread's count, gRPC servers whose handler threads start with it, and the engine-hosting
services that use them (a side thread with an OpenMP team of its own halved the engine's decode rate)."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from decode_svc.server import DecodeInstance
from engine.core import EngineConfig, EngineCore
from engine.loop import EngineLoop
from engine.threads import off_the_engine_thread
from engine.weights import load_checkpoint
from mesh import rpc
from prefill_svc.server import PrefillInstance


def threads_on_another_thread(first=None) -> int:
    seen = []

    def run():
        if first is not None:
            first()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_a_thread_off_the_engine_runs_torch_on_itself_and_the_engine_thread_keeps_its_count():
    engine_threads = torch.get_num_threads()
    if engine_threads < 2:
        pytest.skip("one core: every thread runs torch on one thread anyway")
    assert threads_on_another_thread(off_the_engine_thread) == 1
    assert torch.get_num_threads() == engine_threads  # the caller's own count, not the process's


def test_the_engine_loop_runs_with_its_creators_threads_on_a_thread_of_its_own(tiny_checkpoint):
    engine_threads = torch.get_num_threads()
    if engine_threads < 2:
        pytest.skip("one core: every thread runs torch on one thread anyway")
    folder, _ = tiny_checkpoint("llama")
    loop = EngineLoop(EngineCore(load_checkpoint(str(folder)), EngineConfig(dtype="float32", num_kv_blocks=8)),
                      on_outputs=lambda outs: None)
    threads_on_another_thread(off_the_engine_thread)  # a side thread set one before the loop's thread starts
    loop.start()
    try:
        assert loop.call(torch.get_num_threads) == engine_threads
    finally:
        loop.stop()


def test_servers_with_a_thread_init_run_their_handlers_under_it_and_engine_hosts_use_it():
    def count(request, context):
        return str(torch.get_num_threads()).encode()

    handler = grpc.method_handlers_generic_handler(
        "t.Threads", {"Count": grpc.unary_unary_rpc_method_handler(count)})
    torch.set_num_threads(torch.get_num_threads())  # what a new thread takes: this one's count
    counts = {}
    for init in (None, off_the_engine_thread):
        links = rpc.Links("127.0.0.1", thread_init=init)
        address = links.serve([(lambda _servicer, server: server.add_generic_rpc_handlers((handler,)), None,
                                "t.Threads")])
        with grpc.insecure_channel(address) as channel:
            counts[init] = int(channel.unary_unary("/t.Threads/Count")(b"", timeout=10))
        links.close()
    assert counts[off_the_engine_thread] == 1
    assert counts[None] == torch.get_num_threads()
    assert DecodeInstance.rpc_thread_init is off_the_engine_thread is PrefillInstance.rpc_thread_init
