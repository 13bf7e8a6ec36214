"""The mooncake KV transport over real Transfer Engines on loopback (tcp): decode grants only its
reservation's slots and holds them while prefill writes; a decode rank killed mid-write fails the push, a
prefill rank killed mid-write lets the hold go; refusals are typed and the service keeps serving. (Bit for bit
between block sizes: tests/test_kvtransfer_transport.py; CP=2 prefill into TP=2 decode:
tests/test_tp_decode_service.py; the whole mesh: tests/test_mesh_processes.py.)"""

from __future__ import annotations

import grpc
import pytest
import torch
import torch.multiprocessing as mp

from kvtransfer import mooncake, transports
from kvtransfer.transport import KVReceiver, TransferError, TransferState
from kvtransfer.transports import KVOptions
from mesh.rpc import Links
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc
from tests.helpers import wait_until

TCP = KVOptions("tcp", "")
SHAPE = (4, 16, 3, 8)  # blocks, block size, heads, head_dim
RESERVED = (1, 2)  # request "r" holds slots [16, 48)


def cache_and_receiver(on_landed=None):
    kv = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(2)]
    tables = {"r": RESERVED}
    return kv, tables, KVReceiver(kv, tables.get, on_landed=on_landed)


@pytest.fixture
def endpoint():
    landed: list[str] = []
    kv, tables, receiver = cache_and_receiver(on_landed=landed.append)
    links = Links("127.0.0.1", options=TCP)
    served = mooncake.Endpoint(0, 1, receiver, links, None)
    yield served, kv, tables, receiver, landed, links
    served.stop()
    links.close()


def sender_to(address: str, request_id: str = "r", timeout_s: float = 30.0):
    links = Links("127.0.0.1", options=TCP)
    return mooncake.Dialer(0, 1, links).senders((address,), 0, request_id, timeout_s)[0]


def test_a_push_lands_in_the_granted_slots_and_the_grant_is_the_reservation_alone(endpoint):
    served, kv, _, receiver, _, _ = endpoint
    keys, values = torch.randn(2, 2, 32, 3, 8)
    sender = sender_to(served.address)
    sender.open(last_layer=1)
    for layer in range(2):
        sender.send_runs(layer, [(16, 32)], keys[layer], values[layer])
        sender.flush()
        assert receiver.landings("r") == 1  # held while prefill writes
    stats = sender.finish()
    assert sender.state is TransferState.DONE and stats.bytes == 2 * keys.numel() * 4
    assert receiver.landings("r") == 0
    for layer in range(2):
        assert torch.equal(kv[layer][0].view(-1, 3, 8)[16:48], keys[layer])
        assert torch.equal(kv[layer][1].view(-1, 3, 8)[16:48], values[layer])
        assert not kv[layer][0].view(-1, 3, 8)[:16].any() and not kv[layer][0].view(-1, 3, 8)[48:].any()

    with grpc.insecure_channel(served.address) as channel:  # what decode grants: the runs' own addresses
        opened = internal_pb2.KVWriteRequest(open=internal_pb2.KVWriteOpen(
            request_id="r", first_layer=1, last_layer=1, dst_slots=[20], run_tokens=[4],
            dtype=internal_pb2.DTYPE_FLOAT32))
        grant = next(internal_pb2_grpc.KVWriteStub(channel).Write(iter([opened]), timeout=30)).grant
    row = 3 * 8 * 4
    assert list(grant.keys) == [kv[1][0].data_ptr() + 20 * row]
    assert list(grant.values) == [kv[1][1].data_ptr() + 20 * row]
    wait_until(lambda: receiver.landings("r") == 0)  # the stream ended without `done`: the hold goes


@pytest.mark.parametrize("request_id,runs,error", [
    ("ghost", [(16, 4)], "NOT_FOUND: request 'ghost' has no KV reservation here"),
    ("r", [(40, 16)], r"INVALID_ARGUMENT: slots \[40, 56\) are not inside blocks reserved for 'r'"),
])
def test_a_write_outside_the_reservation_is_refused_before_any_byte_and_decode_keeps_serving(endpoint, request_id,
                                                                                            runs, error):
    served, kv, _, receiver, _, _ = endpoint
    n = sum(t for _, t in runs)
    sender = sender_to(served.address, request_id)
    sender.send_runs(0, runs, torch.ones(n, 3, 8), torch.ones(n, 3, 8))
    with pytest.raises(TransferError, match=error):
        sender.finish()
    assert sender.state is TransferState.FAILED
    assert not any(t.any() for layer in kv for t in layer) and receiver.landings("r") == 0
    again = sender_to(served.address)
    again.send_runs(0, [(16, 4)], torch.ones(4, 3, 8), torch.ones(4, 3, 8))
    assert again.finish().bytes == 2 * 4 * 3 * 8 * 4


@pytest.mark.parametrize("first,error", [
    (internal_pb2.KVWriteRequest(done=internal_pb2.KVWriteDone()), "begins with `open`"),
    (internal_pb2.KVWriteRequest(open=internal_pb2.KVWriteOpen(request_id="r", dst_rank=1, dtype=1)), "for rank 1"),
    (internal_pb2.KVWriteRequest(open=internal_pb2.KVWriteOpen(request_id="r", dst_slots=[16])), "must name a dtype"),
])
def test_a_malformed_write_stream_is_invalid_argument_naming_what(endpoint, first, error):
    served = endpoint[0]
    with grpc.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            list(internal_pb2_grpc.KVWriteStub(channel).Write(iter([first]), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error in e.value.details()


def dying_decode_worker(rank: int, results) -> None:
    """A decode rank with request "r" reserved: its endpoint's address, then it waits to be killed."""
    _, _, receiver = cache_and_receiver()
    links = Links("127.0.0.1", options=TCP)
    results.put(mooncake.Endpoint(0, 1, receiver, links, None).address)
    mp.get_context("spawn").Event().wait()


def test_a_decode_rank_killed_mid_write_fails_the_push():
    results = mp.get_context("spawn").SimpleQueue()
    workers = mp.start_processes(dying_decode_worker, args=(results,), nprocs=1, join=False, start_method="spawn")
    sender = sender_to(results.get())
    sender.open(last_layer=1)
    sender.send_runs(0, [(16, 32)], torch.ones(32, 3, 8), torch.ones(32, 3, 8))
    sender.flush()  # granted and written
    (process,) = workers.processes
    process.kill()
    process.join(30)
    sender.send_runs(1, [(16, 32)], torch.ones(32, 3, 8), torch.ones(32, 3, 8))
    with pytest.raises(TransferError, match="failed"):
        sender.finish()
    assert sender.state is TransferState.FAILED


def dying_prefill_worker(rank: int, address: str, results) -> None:
    """A prefill rank that writes the first of two layers of "r", says so, then waits to be killed."""
    sender = sender_to(address)
    sender.open(last_layer=1)
    sender.send_runs(0, [(16, 32)], torch.ones(32, 3, 8), torch.ones(32, 3, 8))
    sender.flush()
    results.put("written")
    mp.get_context("spawn").Event().wait()


def test_a_prefill_rank_killed_mid_write_lets_the_hold_go_and_the_owner_frees_the_blocks(endpoint):
    served, _, tables, receiver, landed, _ = endpoint
    results = mp.get_context("spawn").SimpleQueue()
    workers = mp.start_processes(dying_prefill_worker, args=(served.address, results), nprocs=1, join=False,
                                 start_method="spawn")
    assert results.get() == "written" and receiver.landings("r") == 1
    with receiver.lock:
        del tables["r"]  # the reservation ends (a cancel) while prefill may still write: its blocks stay held
    (process,) = workers.processes
    process.kill()
    process.join(30)
    wait_until(lambda: landed == ["r"])  # the broken stream closed the hold; the owner may reuse the blocks
    assert receiver.landings("r") == 0


def test_a_follower_waits_for_open_writes_before_a_step_reuses_an_ended_reservation(endpoint):
    served, _, tables, receiver, _, _ = endpoint
    sender = sender_to(served.address)
    sender.open(last_layer=1)
    sender.send_runs(0, [(16, 32)], torch.ones(32, 3, 8), torch.ones(32, 3, 8))
    sender.flush()
    with receiver.lock:
        del tables["r"]
        assert not receiver.wait_landed(["r"], 0.0)  # a write is open: the step would wait
    sender.send_runs(1, [(16, 32)], torch.ones(32, 3, 8), torch.ones(32, 3, 8))
    sender.finish()
    with receiver.lock:
        assert receiver.wait_landed(["r"], 0.0)


def test_a_transport_whose_package_is_missing_is_not_offered_and_says_what_to_install():
    missing = transports.Transport("mooncake", internal_pb2.KV_TRANSPORT_MOONCAKE, "kvtransfer.mooncake",
                                   requires="mooncake_not_installed.engine")
    assert not missing.usable("cpu")
    assert missing.needs("cpu") == "mooncake_not_installed installed (pip install 'infermesh[mooncake]')"
    assert transports.by_name("mooncake").usable("cuda")  # installed here; its CUDA build registers GPU memory


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and infermesh[mooncake-cuda]")
def test_a_push_between_cuda_caches_lands_bit_for_bit():
    """The CUDA path: decode's cache in GPU memory, registered as it is; prefill writes from GPU memory (a view
    of its cache, and a staged gather of half its heads)."""
    kv = [(torch.zeros(SHAPE, device="cuda"), torch.zeros(SHAPE, device="cuda")) for _ in range(2)]
    tables = {"r": RESERVED}
    receiver = KVReceiver(kv, tables.get)
    links = Links("127.0.0.1", options=TCP)
    served = mooncake.Endpoint(0, 1, receiver, links, None)
    try:
        source = torch.randn(2, 2, 32, 4, 8, device="cuda")  # layers, keys/values, tokens, 4 heads, head_dim
        sender = sender_to(served.address)
        sender.open(last_layer=1)
        sender.send_runs(0, [(16, 32)], source[0, 0, :, :3], source[0, 1, :, :3])  # not contiguous: staged
        sender.send_runs(1, [(16, 32)], source[1, 0, :, :3].contiguous(), source[1, 1, :, :3].contiguous())
        assert sender.finish().bytes == 2 * 2 * 32 * 3 * 8 * 4
        for layer in range(2):
            assert torch.equal(kv[layer][0].view(-1, 3, 8)[16:48], source[layer, 0, :, :3])
            assert torch.equal(kv[layer][1].view(-1, 3, 8)[16:48], source[layer, 1, :, :3])
    finally:
        served.stop()
        links.close()
