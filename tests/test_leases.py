"""A KV reservation is a lease: when the prefill instance pushing into it is killed mid-push and the router
that made it is gone too, nobody joins it; it expires, its blocks (with the partial KV) are freed, and a
late join is told NOT_FOUND. A join within the lease runs to its end; each KV piece that arrives renews
the lease. A prefill slower than the lease (a long queue) costs the client nothing: the router's late
join finds no reservation and decode prefills the request itself, with the same tokens. A reservation
that ends while KV is landing straight in its blocks keeps them from reuse until the landing closes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import grpc
import pytest
import torch

from decode_svc.core import DecodeCore
from decode_svc.server import DecodeInstance
from engine import LLM
from engine.core import EngineConfig, EngineCore
from engine.weights import load_checkpoint
from mesh import rpc
from mesh.metrics import scrape
from mesh.registry import MemoryRegistry, Role
from mesh.registry.remote import RegistryService
from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from protos.convert import sampling_message
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc
from router.server import RouterInstance
from tests.helpers import kv_blocks_used, wait_until
from tests.test_decode_service import collect
from tests.test_lifecycle import LONG
from tests.test_router import generate


@pytest.mark.slow
def test_a_reservation_nobody_joins_expires_and_frees_its_blocks_even_mid_push():
    registry = MemoryRegistry()
    server, port, _ = rpc.start_server("127.0.0.1", 0, [(internal_pb2_grpc.add_RegistryServicer_to_server,
                                                         RegistryService(registry), "infermesh.v1.Registry")])
    prefill = subprocess.Popen([sys.executable, "-m", "prefill_svc.server", "--model", "smollm2-135m", "--dtype",
                                "float32", "--registry", f"grpc://127.0.0.1:{port}", "--kv-cache-bytes",
                                str(256 << 20)], stdout=subprocess.DEVNULL)
    decode = DecodeInstance(DecodeSettings(model="smollm2-135m", dtype="float32", kv_cache_bytes=256 << 20,
                                           reservation_lease_s=3.0), registry=registry)
    try:
        wait_until(lambda: len(registry.instances(Role.PREFILL)) == 1, timeout_s=120)
        (record,) = registry.instances(Role.PREFILL)
        stub, admin = internal_pb2_grpc.DecodeStub(rpc.channel(decode.address)), internal_pb2_grpc.AdminStub(
            rpc.channel(decode.address))
        prompt = [(i * 37) % 40000 + 100 for i in range(3000)]
        target = stub.Reserve(internal_pb2.ReserveRequest(request_id="orphan", prompt_token_ids=prompt,
                                                          sampling=sampling_message(LONG)), timeout=10).target
        assert kv_blocks_used(admin) >= 3000 // 16
        failed = []

        def push():
            try:
                internal_pb2_grpc.PrefillStub(rpc.channel(record.address)).Prefill(internal_pb2.PrefillRequest(
                    request_id="orphan", prompt_token_ids=prompt, target=target), timeout=120)
            except grpc.RpcError as e:
                failed.append(e.code())

        first_piece, receive = threading.Event(), decode.core.receiver.reserved

        def stop_prefill_at_the_first_piece(request_id: str):
            if not first_piece.is_set():  # it cannot finish the push (nor answer) from here on
                prefill.send_signal(signal.SIGSTOP)
                first_piece.set()
            return receive(request_id)

        decode.core.receiver.reserved = stop_prefill_at_the_first_piece
        pushing = threading.Thread(target=push)
        pushing.start()
        assert first_piece.wait(timeout=120)
        prefill.send_signal(signal.SIGKILL)  # the prefill instance dies mid-push; the "router" never joins
        pushing.join(60)
        assert failed == [grpc.StatusCode.UNAVAILABLE]  # it died before answering
        wait_until(lambda: kv_blocks_used(admin) == 0, timeout_s=30)  # the lease ran out
        with pytest.raises(grpc.RpcError) as e:
            collect(stub.Decode(internal_pb2.DecodeRequest(request_id="orphan",
                                                           kv_status=internal_pb2.KV_STATUS_FAILED), timeout=30))
        assert e.value.code() is grpc.StatusCode.NOT_FOUND

        stub.Reserve(internal_pb2.ReserveRequest(request_id="joined", prompt_token_ids=prompt[:40],
                                                 sampling=sampling_message(LONG)), timeout=10)
        tokens, _ = collect(stub.Decode(internal_pb2.DecodeRequest(  # joined (to recompute) within its lease
            request_id="joined", kv_status=internal_pb2.KV_STATUS_FAILED), timeout=60))
        assert len(tokens) == LONG.max_tokens and kv_blocks_used(admin) == 0
    finally:
        decode.stop()
        prefill.kill()
        prefill.wait()
        server.stop(None)


def test_each_kv_piece_renews_the_lease(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    decode = DecodeInstance(DecodeSettings(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22,
                                           reservation_lease_s=2.0), registry=MemoryRegistry())
    now = [0.0]
    decode.core.clock = lambda: now[0]  # the lease's clock, moved by the test
    try:
        decode.core.reserve("r", [5, 6, 7], LONG)
        for _ in range(3):  # 3.6 s in all, a lease of 2 s: a piece every 1.2 s keeps it
            now[0] += 1.2
            assert decode.core.reserved("r") is not None  # what the KV receiver asks for each piece
        assert "r" in decode.core.reservations
        now[0] += 2.0
        wait_until(lambda: "r" not in decode.core.reservations, timeout_s=10)  # no more pieces: it expires
        assert decode.core.engine.blocks.num_used_blocks == 0
    finally:
        decode.stop()


def test_a_prefill_slower_than_the_lease_is_prefilled_on_decode_with_the_same_tokens(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22)
    prefill = PrefillInstance(PrefillSettings(**common), registry=registry)
    decode = DecodeInstance(DecodeSettings(reservation_lease_s=1.0, **common), registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder), local_prefill_max_tokens=4), registry=registry)
    engine_step, lease_over = prefill.core.engine.step, threading.Event()
    prefill.core.engine.step = lambda: lease_over.wait() and engine_step()  # queued until the lease has run out

    def end_of_the_lease():
        wait_until(lambda: decode.core.reservations, timeout_s=60)  # reserved by the router
        wait_until(lambda: not decode.core.reservations, timeout_s=60)  # and expired, no KV having come
        lease_over.set()

    watcher = threading.Thread(target=end_of_the_lease, daemon=True)
    watcher.start()
    try:
        wait_until(lambda: len(registry.instances()) == 3)
        prompt = [5 + i % 200 for i in range(40)]
        tokens, final = generate(router.address, prompt, LONG)
        assert lease_over.is_set()
        assert tokens == LLM(str(folder), dtype="float32").generate([prompt], LONG)[0].token_ids
        assert final.usage.completion_tokens == LONG.max_tokens
        assert scrape(router.metrics.url)[("infermesh_retries_total", ())] == 1  # the late join, then decode
        assert decode.core.engine.blocks.num_used_blocks == 0 and decode.core.in_flight == 0
    finally:
        for instance in (router, prefill, decode):
            instance.stop()


def landing(core: DecodeCore, request_id: str):
    """The first block's keys and values landing, as a transport receiving into the cache opens it."""
    k_cache = core.engine.kv_cache[0][0]
    return core.receiver.landing(request_id, range(1), [(core.reservations[request_id][0] * k_cache.shape[1], 4)],
                                 (4, *k_cache.shape[2:]), k_cache.dtype)


def test_blocks_a_cancel_frees_while_kv_lands_in_them_are_held_until_the_landing_closes(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    engine = EngineCore(load_checkpoint(str(folder)), EngineConfig(dtype="float32", num_kv_blocks=16))
    core = DecodeCore(engine).start()
    prompt = [5 + i % 200 for i in range(40)]
    try:
        core.reserve("cancelled", prompt, LONG)
        with landing(core, "cancelled") as [(keys, _)]:
            assert core.cancel("cancelled")  # the client left mid-push
            assert engine.blocks.num_used_blocks == 3  # not reusable while the receive writes into them
            keys.fill_(1.0)
        wait_until(lambda: engine.blocks.num_used_blocks == 0)  # freed on the engine thread once closed

        core.reserve("joined", prompt, LONG)  # KV still landing when the router joins: recomputed, not trusted
        with landing(core, "joined") as [(keys, _)]:
            stream = core.join("joined", first_token=7).result()
            keys.fill_(torch.nan)  # a late write cannot reach the recomputed request's blocks
        tokens, event = [], None
        while event is None or not event.finish_reason:
            event = stream.get(timeout=60)
            tokens += event.token_ids
        assert tokens == LLM(str(folder), dtype="float32").generate([prompt], LONG)[0].token_ids
        wait_until(lambda: engine.blocks.num_used_blocks == 0 and core.in_flight == 0)
    finally:
        core.stop()
