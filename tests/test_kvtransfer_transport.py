"""KV transports move the KV bit-exactly into reserved blocks, and fail clearly: gRPC stream and shared
memory over loopback (bit for bit between block sizes; refused, unreachable and timed out — then
recomputed on decode; shared memory refuses files that are not its own and leaves none behind)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core import EngineConfig, EngineCore
from engine.errors import NoReservation
from engine.kv_cache import KVStripe
from engine.weights import load_checkpoint
from kvtransfer import grpc_stream, local_socket, mooncake, shared_memory, shm_arena
from kvtransfer.grpc_stream import GrpcStreamSender
from kvtransfer.plan import DecodeLayout, Piece
from kvtransfer.sink import PlanSink
from kvtransfer.torch_p2p import part_pair
from kvtransfer.transport import KVReceiver, LoopbackSender, PieceRejected, TransferError, TransferState, run_rows
from kvtransfer.transports import KVOptions
from mesh.rpc import Links, start_server
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc
from tests.conftest import TINY_VOCAB
from tests.helpers import wait_until
from tests.test_local_socket import push_threads

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def reservations(engine: EngineCore):
    def reserved(request_id: str):
        seq = engine._sequences.get(request_id)
        return tuple(seq.block_table) if seq is not None and seq.status.value == "reserved" else None

    return reserved


@pytest.fixture
def pair(tiny_checkpoint, request):
    """A prefill engine (block size 8) and a decode engine (block size 16) behind a real endpoint of the
    transport module `request.param` (default grpc_stream: a gRPC server; shared_memory: its socket;
    `(module, True)`: prefill's KV cache in shared memory), what its senders are given to reach it (a channel,
    a path), and that module's sender class."""
    transport, shared = (request.param if isinstance(request.param, tuple) else (request.param, False)) \
        if hasattr(request, "param") else (grpc_stream, False)
    folder, _ = tiny_checkpoint("qwen3")
    checkpoint = load_checkpoint(str(folder))
    prefill = EngineCore(checkpoint, EngineConfig(dtype="float32", block_size=8, num_kv_blocks=64),
                         kv_memory=shm_arena.shared_zeros if shared else None)
    decode = EngineCore(checkpoint, EngineConfig(dtype="float32", block_size=16, num_kv_blocks=32))
    receiver = KVReceiver(decode.kv_cache, reservations(decode))
    reference = LLM(str(folder), dtype="float32")
    if transport is shared_memory:
        endpoint = shared_memory.Endpoint(0, 1, receiver, links=None, shared_address=None)
        yield prefill, decode, endpoint.address, reference, shared_memory.SharedMemorySender
        endpoint.stop()
        return
    if transport is mooncake:  # one Transfer Engine in this process: prefill writes to its own segment
        links = Links("127.0.0.1", options=KVOptions("tcp", ""))
        endpoint, dialer = mooncake.Endpoint(0, 1, receiver, links, None), mooncake.Dialer(0, 1, links)
        yield prefill, decode, endpoint.address, reference, \
            lambda address, request_id, rank, timeout_s=60.0: dialer.senders((address,), 0, request_id, timeout_s)[0]
        endpoint.stop()
        links.close()
        return
    server, port, _ = start_server("127.0.0.1", 0, [(grpc_stream.add_to_server, grpc_stream.KVTransferService(receiver),
                                                     "infermesh.v1.KVTransfer")])  # with the typed-error edge
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield prefill, decode, channel, reference, GrpcStreamSender
    channel.close()
    server.stop(None)


def transfer(prefill: EngineCore, decode: EngineCore, channel, request_id: str, prompt: list[int],
             timeout_s: float = 60.0, sender=GrpcStreamSender):
    """Prefill `prompt` and push its KV into a reservation on decode: (the sink, the first token, the prefill
    side's block table: its blocks keep the KV until another prompt takes them)."""
    seq = decode.reserve(request_id, prompt, GREEDY)
    target = DecodeLayout(head_ranges=((0, decode.model_config.num_kv_heads),), block_size=16,
                          block_table=tuple(seq.block_table), first_token=seq.num_cached_prompt_tokens)
    sink = PlanSink(num_tokens=len(prompt), num_kv_heads=prefill.model_config.num_kv_heads, block_size=8,
                    num_layers=len(prefill.kv_cache), target=target,
                    senders=[sender(channel, request_id, 0, timeout_s=timeout_s)])
    prefill.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_sink=sink)
    freed, free = [], prefill.blocks.free  # the request's table, as it is freed (and emptied) when it finishes
    prefill.blocks.free = lambda table: freed.append(list(table)) or free(table)
    first = None
    try:
        while prefill.has_unfinished():
            for out in prefill.step():
                first = out.new_token_ids[0]
    finally:
        prefill.blocks.free = free
    (source_table,) = freed
    return sink, first, source_table


@pytest.mark.parametrize("pair", [grpc_stream, shared_memory, (shared_memory, True), mooncake], indirect=True,
                         ids=["grpc_stream", "shared_memory", "shared_memory-from-the-cache", "mooncake"])
def test_kv_moves_between_block_sizes_and_decode_continues_exactly(pair):
    prefill, decode, channel, reference, sender = pair
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (9, 37)]
    expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    outs = {}
    in_place = shm_arena.arena().owns(prefill.kv_cache[0][0]) is not None
    for i, prompt in enumerate(prompts):
        staged = shm_arena.arena().taken_bytes
        sink, first, source_table = transfer(prefill, decode, channel, f"r{i}", prompt, sender=sender)
        if in_place:  # decode read each layer from prefill's cache: nothing staged, and done when the step ended
            assert shm_arena.arena().taken_bytes == staged and all(s.state is TransferState.DONE for s in sink.senders)
        stats = sink.finish()
        assert all(s.state is TransferState.DONE for s in sink.senders)
        layers, heads, head_dim = 2, decode.model_config.num_kv_heads, decode.model_config.head_dim
        assert stats.bytes == layers * 2 * len(prompt) * heads * head_dim * 4
        target_table = decode._sequences[f"r{i}"].block_table
        for (source_k, source_v), (k, v) in zip(prefill.kv_cache, decode.kv_cache):  # bit for bit, every token
            for t in range(len(prompt)):
                source, slot = (source_table[t // 8], t % 8), (target_table[t // 16], t % 16)
                assert torch.equal(k[slot], source_k[source]) and torch.equal(v[slot], source_v[source])
        outs[f"r{i}"] = list(decode.join(f"r{i}", first).new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            outs[out.request_id] += out.new_token_ids
    assert [outs["r0"], outs["r1"]] == expected


def test_pieces_for_a_request_without_reservation_fail_the_transfer_with_not_found(pair):
    _, _, channel, _, _ = pair
    sender = GrpcStreamSender(channel, "ghost", 0)
    sender.send(0, Piece(0, 0, (0, 1), (0, 2), 0, 0), torch.zeros(1, 2, 32), torch.zeros(1, 2, 32))
    with pytest.raises(TransferError, match="NOT_FOUND: request 'ghost' has no KV reservation here"):
        sender.finish(timeout_s=10)
    assert sender.state is TransferState.FAILED


@pytest.mark.parametrize("pair", [grpc_stream, shared_memory], indirect=True, ids=["grpc_stream", "shared_memory"])
def test_a_piece_outside_the_reserved_blocks_is_refused(pair):
    _, decode, channel, _, sender_class = pair
    decode.reserve("r", [5] * 10, GREEDY)
    outside = max(decode._sequences["r"].block_table) + 1
    sender = sender_class(channel, "r", 0)
    sender.send(0, Piece(0, 0, (0, 2), (0, 2), 0, outside * 16), torch.zeros(2, 2, 32), torch.zeros(2, 2, 32))
    refusal = "PieceRejected" if sender_class is shared_memory.SharedMemorySender else "INVALID_ARGUMENT"
    with pytest.raises(TransferError, match=rf"{refusal}: slots \[\d+, \d+\) are not inside blocks reserved"):
        sender.finish(timeout_s=10)


class HungKVTransfer(internal_pb2_grpc.KVTransferServicer):
    """A decode side that takes the stream and never answers (a peer stuck in a long pause)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Push(self, request_iterator, context):
        self.release.wait(60)
        return internal_pb2.PushResponse()


def test_a_transfer_that_times_out_is_recomputed_on_decode(pair):
    prefill, decode, _, reference, _ = pair
    hung = HungKVTransfer()
    server, port, _ = start_server("127.0.0.1", 0, [(internal_pb2_grpc.add_KVTransferServicer_to_server, hung,
                                                     "infermesh.v1.KVTransfer")])
    prompt = [5 + i % 100 for i in range(37)]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            sink, first, _ = transfer(prefill, decode, channel, "t", prompt, timeout_s=2)
            with pytest.raises(TransferError, match="DEADLINE_EXCEEDED"):  # timed out, not refused
                sink.finish()
    finally:
        hung.release.set()
        server.stop(None)
    decode.recompute("t")  # what the decode service does when the prefill reports the transfer failed
    tokens = []
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == reference.generate([prompt], GREEDY)[0].token_ids
    assert decode.blocks.num_used_blocks == 0


def test_an_unreachable_decode_fails_the_transfer_within_the_timeout():
    channel = grpc.insecure_channel("127.0.0.1:1")
    sender = GrpcStreamSender(channel, "r", 0, timeout_s=2)
    with pytest.raises(TransferError, match="UNAVAILABLE|DEADLINE_EXCEEDED"):  # as soon as the failure is known
        for _ in range(1000):
            sender.send(0, Piece(0, 0, (0, 1), (0, 1), 0, 0), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
        sender.finish(timeout_s=5)
    assert sender.state is TransferState.FAILED


def push_messages(address: str, *pieces: internal_pb2.KVPiece) -> bytes:
    """`pieces` as one push to the shared-memory endpoint at `address`, written by hand; its reply."""
    connection = local_socket.Connection(address, 10.0, "KV push")
    for piece in pieces:
        connection.send(piece.SerializeToString())
    return connection.finish(10.0)


@pytest.mark.parametrize("tokens", [2048, 3, 0])
def test_a_layer_message_written_by_hand_is_what_protobuf_writes_and_reads(tokens):
    keys, values = torch.randn(tokens, 3, 64).bfloat16(), torch.randn(tokens, 3, 64).bfloat16()
    piece = internal_pb2.KVPiece(request_id="req-1", layer=29, dst_rank=1, dst_slots=[32, 400],
                                 run_tokens=[tokens, 0], dtype=internal_pb2.DTYPE_BFLOAT16)
    by_hand = grpc_stream.wire_message(piece, keys, values)
    piece.keys, piece.values = (bytes(grpc_stream.tensor_buffer(t)) for t in (keys, values))
    assert internal_pb2.KVPiece.FromString(by_hand) == piece
    if tokens:  # protobuf leaves empty bytes fields out; the hand-written message has them, empty
        assert by_hand == piece.SerializeToString()


def test_a_message_read_off_the_wire_is_what_protobuf_reads_in_any_field_order():
    keys, values, stale = (torch.randn(5, 3, 64).bfloat16() for _ in range(3))
    head = internal_pb2.KVPiece(request_id="req-1", layer=300, dst_rank=1, dst_slots=[32, (1 << 32) - 1],
                                run_tokens=[5, 0], dtype=internal_pb2.DTYPE_BFLOAT16, shm_values_offset=0,
                                more_layers=[internal_pb2.KVLayerRef(layer=2, keys_offset=7)])
    keys_field, values_field, stale_keys_field = (
        grpc_stream._field_prefix(number, t.numel() * t.element_size()) + bytes(grpc_stream.tensor_buffer(t))
        for number, t in ((grpc_stream.KEYS_FIELD, keys), (grpc_stream.VALUES_FIELD, values),
                          (grpc_stream.KEYS_FIELD, stale)))
    orders = [grpc_stream.wire_message(head, keys, values),
              values_field + head.SerializeToString() + keys_field,  # the tensors around the other fields
              stale_keys_field + grpc_stream.wire_message(head, keys, values)]  # keys twice: the last one counts
    for data in orders + [head.SerializeToString()]:
        piece = grpc_stream.read_piece(data)
        reference = internal_pb2.KVPiece.FromString(data)
        assert bytes(piece.keys) == reference.keys and bytes(piece.values) == reference.values
        reference.ClearField("keys")
        reference.ClearField("values")
        assert piece.head == reference == head


@pytest.mark.parametrize("data,error", [
    (b"\x08", "malformed or truncated varint"),  # layer's value missing
    (b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "malformed or truncated varint"),
    (b"\x3a\x10abc", "truncated: field 7 ends at byte 18 of 5"),  # keys says 16 bytes, carries 3
    (b"\x0b\x0c", "field 1 has wire type 3"),
    (b"\x0a\x02\xff\xfe", "does not parse"),  # request_id is not UTF-8
])
def test_a_malformed_message_is_refused_by_name_and_the_service_keeps_serving(pair, data, error):
    _, decode, channel, _, _ = pair
    with pytest.raises(PieceRejected, match=error):
        grpc_stream.read_piece(data)
    push = channel.stream_unary("/infermesh.v1.KVTransfer/Push", request_serializer=None,
                                response_deserializer=internal_pb2.PushResponse.FromString)
    with pytest.raises(grpc.RpcError) as refused:
        push(iter([data]), timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and error.split(":")[0] in refused.value.details()
    assert push(iter([]), timeout=10) == internal_pb2.PushResponse()  # and the next stream is served


@pytest.mark.parametrize("pair", [shared_memory], indirect=True, ids=["shared_memory"])
def test_shared_memory_refuses_a_file_that_is_not_its_own(pair, tmp_path):
    _, decode, address, _, _ = pair
    decode.reserve("r", [5] * 10, GREEDY)
    slot = decode._sequences["r"].block_table[0] * 16
    outside = tmp_path / f"{shared_memory.PREFIX}x"
    outside.write_bytes(b"\0" * 4096)
    for path in ("/etc/passwd", f"{shared_memory.SHM_DIR}/../etc/passwd", str(outside), ""):
        piece = internal_pb2.KVPiece(request_id="r", layer=0, dst_slots=[slot], run_tokens=[1],
                                     dtype=internal_pb2.DTYPE_FLOAT32, shm_path=path)
        with pytest.raises(TransferError, match=rf"PieceRejected: shm_path must be a file {shared_memory.SHM_DIR}/"
                                                rf"{shared_memory.PREFIX}\*, got {path!r}"):
            push_messages(address, piece)
    assert outside.exists()  # neither read nor unlinked


@pytest.mark.parametrize("pair", [shared_memory], indirect=True, ids=["shared_memory"])
def test_shared_memory_gives_regions_back_after_a_push_and_discards_those_of_failed_ones(pair):
    prefill, decode, address, _, sender_class = pair
    staging = shm_arena.arena()
    before = staging.taken_bytes
    sink, _, _ = transfer(prefill, decode, address, "ok", [5 + i for i in range(37)], sender=sender_class)
    sink.finish()
    assert staging.taken_bytes == before and staging.idle_bytes > 0  # acknowledged: ready for the next push
    refused = sender_class(address, "ghost", 0)  # no reservation: decode ends the stream at the first piece
    refused.send(0, Piece(0, 0, (0, 1), (0, 2), 0, 0), torch.full((1, 2, 32), 7.0), torch.full((1, 2, 32), 7.0))
    refused.flush()  # staged and sent
    (region,) = refused._regions
    assert region.tensor[:256].view(torch.float32).eq(7.0).all()
    with pytest.raises(TransferError, match="NoReservation: request 'ghost' has no KV reservation here"):
        refused.finish(timeout_s=10)
    assert staging.taken_bytes == before and not refused._regions
    assert not region.tensor.any()  # its pages went back: a late reader sees zeros, not a later push
    assert all(staging.take(region.size).offset != region.offset for _ in range(3))  # nor handed out again soon
    unreachable = sender_class(f"{shared_memory.SHM_DIR}/{shared_memory.PREFIX}1-gone.sock", "r", 0, timeout_s=2)
    with pytest.raises(TransferError, match="cannot connect to .*: No such file or directory"):
        unreachable.send(0, Piece(0, 0, (0, 1), (0, 2), 0, 0), torch.zeros(1, 2, 32), torch.zeros(1, 2, 32))
        unreachable.finish(timeout_s=5)
    assert not unreachable._regions and os.path.exists(unreachable.path)  # the file lives with its process


def test_the_staging_file_goes_with_its_process_and_a_full_dev_shm_fails_the_push_or_names_itself_to_a_cache():
    shm = os.statvfs(shm_arena.SHM_DIR)
    too_much = shm.f_bavail * shm.f_frsize + (1 << 30)  # more than /dev/shm has free
    code = ("import torch\nfrom kvtransfer import shm_arena, shared_memory\n"
            "print(shm_arena.arena().path, flush=True)\n"
            "s = shared_memory.SharedMemorySender('/dev/shm/nothing.sock', 'r', 0)\n"
            f"assert s.layer_buffers(({too_much}, 1, 1), torch.int8) is None  # the sink gathers anywhere\n"
            f"try:\n    s._take({too_much})\nexcept Exception as e:\n    print(repr(e), flush=True)\n"
            f"try:\n    shm_arena.shared_zeros(({too_much},), torch.uint8)\n"
            "except Exception as e:\n    print(repr(e), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path, error, cache_error = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert error.startswith(f"TransferError('cannot stage {too_much} bytes of KV in /dev/shm: No space left")
    assert cache_error.startswith(f"OSError(28, 'cannot hold {too_much} bytes of KV cache in /dev/shm: No space")
    assert "a --kv-transport other than shared_memory" in cache_error  # and what to do about it
    assert path.startswith(f"{shm_arena.SHM_DIR}/{shm_arena.PREFIX}") and not os.path.exists(path)


def test_decode_drops_the_mapping_of_a_killed_sender_and_the_next_sender_sweeps_its_file():
    code = ("import sys, time\nfrom kvtransfer import shm_arena\na = shm_arena.arena()\n"
            "a.take(1 << 20).tensor.fill_(7)\nprint(a.path, flush=True)\ntime.sleep(60)\n")
    sender = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = sender.stdout.readline().strip()
    service = shared_memory.SharedMemoryService(receiver=None)
    try:
        assert service._file(path)[:16].eq(7).all()  # decode maps a live sender's staging file
        sender.kill()  # the prefill process dies (SIGKILL: no exit handler unlinks its file)
        sender.wait()
        assert os.path.exists(path)
        service._file(shm_arena.arena().path)  # the next sender decode hears from
        assert path not in service._files  # the dead one's mapping is gone: its pages can go back
        shared_memory.Dialer(0, 1, links=None)  # a sender starting on this host sweeps
        assert not os.path.exists(path)
    finally:
        sender.kill()
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.parametrize("pair", [shared_memory], indirect=True, ids=["shared_memory"])
def test_a_push_that_fails_on_the_prefill_side_ends_on_decode_at_once(pair, monkeypatch):
    _, decode, address, _, sender_class = pair
    decode.reserve("r", [5] * 10, GREEDY)
    slot = decode._sequences["r"].block_table[0] * 16
    sender = sender_class(address, "r", 0, timeout_s=60)
    sender.send(0, Piece(0, 0, (0, 1), (0, 2), 0, slot), torch.ones(1, 2, 32), torch.ones(1, 2, 32))
    sender.flush()  # staged and sent: decode is serving the push
    wait_until(push_threads)

    def full(nbytes):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_arena.arena(), "take", full)  # /dev/shm filled up mid-push
    sender.send(1, Piece(0, 0, (0, 1), (0, 2), 0, slot), torch.ones(1, 2, 32), torch.ones(1, 2, 32))
    with pytest.raises(TransferError, match="cannot stage 512 bytes of KV in /dev/shm: No space left"):
        sender.finish(timeout_s=10)
    # decode dropped it now, not at the push's timeout a minute later
    wait_until(lambda: not push_threads(), timeout_s=10)


def test_regions_past_the_pool_give_their_pages_back_and_serve_again_a_failed_one_after_its_quarantine(monkeypatch):
    staging, size = shm_arena.arena(), 7 * 1024 * shm_arena.PAGE  # a class no other test takes
    monkeypatch.setattr(shm_arena, "POOL_BYTES", 0)
    monkeypatch.setattr(shm_arena, "QUARANTINE_S", 0.5)
    first = staging.take(size)
    first.tensor.fill_(5)
    staging.give_back(first)  # past the pool
    assert not first.tensor.any()  # its pages went back to the host
    again = staging.take(size)
    assert again.offset == first.offset  # its offsets serve again: the file does not grow
    staging.discard(again)  # a failed push's: quarantined
    other = staging.take(size)
    assert other.offset != first.offset
    time.sleep(0.6)
    after = staging.take(size)
    assert after.offset == first.offset and not after.tensor.any()
    for region in (other, after):
        staging.give_back(region)


def test_size_classes_are_whole_pages_at_most_a_quarter_larger():
    for nbytes in [1, 4095, 4096, 4097, 5 * 4096 + 1, 1_572_864, 47_185_920, 10**9 + 7]:
        size = shm_arena.size_class(nbytes)
        assert size % shm_arena.PAGE == 0 and nbytes <= size <= max(shm_arena.PAGE, 1.25 * nbytes + shm_arena.PAGE)
    assert len({shm_arena.size_class(n) for n in range(1, 1 << 24, 997)}) <= 4 * 24  # few classes: regions reused


@pytest.mark.parametrize("pair", [shared_memory], indirect=True, ids=["shared_memory"])
def test_shared_memory_refuses_an_offset_outside_the_file_or_misaligned(pair):
    _, decode, address, _, _ = pair
    decode.reserve("r", [5] * 10, GREEDY)
    slot = decode._sequences["r"].block_table[0] * 16
    path = shm_arena.arena().path
    end = shm_arena.VIRTUAL_BYTES - 64  # a tensor of 256 bytes there runs past the file
    for field, offsets in (("shm_offset", dict(shm_offset=end)), ("shm_offset", dict(shm_offset=2)),
                           ("shm_values_offset", dict(shm_offset=0, shm_values_offset=end)),
                           ("shm_values_offset", dict(shm_offset=0, shm_values_offset=6)),
                           ("shm_values_offset", dict(shm_offset=end - 256)),  # values right after the keys
                           ("more_layers[0].values_offset", dict(shm_offset=0, shm_values_offset=256, more_layers=[
                               internal_pb2.KVLayerRef(layer=1, keys_offset=512, values_offset=end)]))):
        piece = internal_pb2.KVPiece(request_id="r", layer=0, dst_slots=[slot], run_tokens=[1],
                                     dtype=internal_pb2.DTYPE_FLOAT32, shm_path=path, **offsets)
        bad = end if field.startswith("more") else offsets.get(field, offsets["shm_offset"] + 256)
        with pytest.raises(TransferError, match=f"PieceRejected: {re.escape(field)} {bad} \\+ 256 bytes is not inside "
                                                f"{path}"):
            push_messages(address, piece)


def test_files_of_killed_senders_are_swept_and_live_ones_kept():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a prefill rank SIGKILLed after writing its file, before decode opened it
    dead = os.path.join(shared_memory.SHM_DIR, f"{shared_memory.PREFIX}{gone.pid}-abc")
    live = os.path.join(shared_memory.SHM_DIR, f"{shared_memory.PREFIX}{os.getpid()}-abc")
    for path in (dead, live):
        with open(path, "wb") as f:
            f.write(b"kv")
    try:
        shared_memory.Dialer(0, 1, links=None)  # a sender starting on this host sweeps
        assert not os.path.exists(dead) and os.path.exists(live)
    finally:
        for path in (dead, live):
            if os.path.exists(path):
                os.unlink(path)


def test_the_socket_of_a_killed_decode_rank_fails_pushes_clearly_and_is_swept():
    code = ("import time, torch\nfrom kvtransfer import shared_memory\nfrom kvtransfer.transport import KVReceiver\n"
            "kv = [(torch.zeros(1, 16, 1, 4), torch.zeros(1, 16, 1, 4))]\n"
            "e = shared_memory.Endpoint(0, 1, KVReceiver(kv, lambda rid: None), links=None, shared_address=None)\n"
            "print(e.address, flush=True)\ntime.sleep(60)\n")
    decode = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        address = decode.stdout.readline().strip()
        decode.kill()  # SIGKILL: no exit handler removes its socket
        decode.wait()
        assert os.path.exists(address)
        sender = shared_memory.SharedMemorySender(address, "r", 0, timeout_s=5)
        sender.send(0, Piece(0, 0, (0, 1), (0, 1), 0, 0), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
        with pytest.raises(TransferError, match="KV push to rank 0: cannot connect to .*: Connection refused"):
            sender.finish(timeout_s=5)
        shared_memory.Dialer(0, 1, links=None)  # a sender starting on this host sweeps
        assert not os.path.exists(address)
    finally:
        decode.kill()


def test_loopback_sender_writes_through_the_same_checks(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    decode = EngineCore(load_checkpoint(str(folder)), EngineConfig(dtype="float32", block_size=16, num_kv_blocks=8))
    seq = decode.reserve("r", [5] * 4, GREEDY)
    sender = LoopbackSender(KVReceiver(decode.kv_cache, reservations(decode)), "r")
    keys = torch.randn(4, 2, 16)
    sender.send(1, Piece(0, 0, (0, 4), (0, 2), 0, seq.block_table[0] * 16), keys, -keys)
    assert sender.finish().pieces == 1
    assert torch.equal(decode.kv_cache[1][0][seq.block_table[0], :4], keys)



@pytest.mark.parametrize("runs", [[(40, 3), (43, 5), (16, 16), (0, 2)], [(2 * i + 1, 1) for i in range(40)]],
                         ids=["a few ranges", "more ranges than slice copies"])
def test_scatter_rows_writes_each_run_where_indexed_assignment_does(runs):
    from kvtransfer.transport import SLICE_COPIES, merge_runs, run_rows, scatter_rows

    assert (len(merge_runs(runs)) > SLICE_COPIES) == (len(runs) == 40)  # both paths are taken
    rows = torch.randn(sum(n for _, n in runs), 3, 8).bfloat16()
    expected, got = torch.zeros(96, 3, 8, dtype=torch.bfloat16), torch.zeros(96, 3, 8, dtype=torch.bfloat16)
    expected[run_rows(runs)] = rows
    scatter_rows(got, runs, rows)
    assert torch.equal(got, expected)
    assert merge_runs([(0, 4), (4, 4), (16, 2), (18, 1), (8, 1)]) == [(0, 8), (16, 3), (8, 1)]

# ---- torch.distributed point-to-point over a pair group: prefill CP ranks + decode TP ranks ---------------


def p2p_worker(rank: int, cp: int, tp: int, port: int, results, land: bool = False) -> None:
    """`land`: decode's blocks lie in a row and its ranks let KV land straight in the cache; their
    `write_runs` refuses everything, so all that arrives must have landed."""
    from engine.parallel.cp_shard import stripe_runs
    from engine.parallel.groups import rendezvous, stateless_group
    from kvtransfer.plan import PrefillLayout, plan
    from kvtransfer.torch_p2p import TorchP2PReceiver, TorchP2PSender

    torch.set_num_threads(1)
    world = cp + tp
    group = stateless_group(rendezvous("127.0.0.1", port, rank, world), "pair", rank, world)
    layers, tokens, heads, head_dim = 2, 45, 3, 8
    truth = torch.randn(layers, 2, tokens, heads, head_dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    table = tuple(range(20, 32))
    src = PrefillLayout(token_ranges=tuple(map(tuple, stripe_runs(table, 0, tokens, 4, cp))), num_kv_heads=heads,
                        block_size=4, block_table=table)
    dst = DecodeLayout(head_ranges=((0, 2), (1, 3))[:tp] if tp == 2 else ((0, 3),), block_size=16,
                       block_table=(5, 6, 7) if land else (7, 2, 5))
    if rank < cp:  # a prefill rank: its tokens only, in its own blocks
        cache = torch.zeros(layers, 2, 40 * 4, heads, head_dim, dtype=torch.bfloat16)
        for start, end in src.token_ranges[rank]:
            for t in range(start, end):
                cache[:, :, src.block_table[t // 4] * 4 + t % 4] = truth[:, :, t]
        senders = {r: TorchP2PSender(group, "req", cp + r) for r in range(tp)}
        pieces = [p for p in plan(src, dst) if p.src_rank == rank]
        for layer in range(layers):
            for p in pieces:
                h = slice(*p.heads)
                rows = slice(p.src_slot, p.src_slot + p.num_tokens)
                senders[p.dst_rank].send(layer, p, cache[layer, 0, rows, h].clone(), cache[layer, 1, rows, h].clone())
            for s in senders.values():
                s.flush()
        stats = [s.finish() for s in senders.values()]
        ghost = TorchP2PSender(group, "ghost", cp)  # decode holds no reservation for this request
        piece = next(p for p in pieces if p.dst_rank == 0)
        zeros = torch.zeros(piece.num_tokens, piece.heads[1] - piece.heads[0], head_dim, dtype=torch.bfloat16)
        ghost.send(0, piece, zeros, zeros)
        try:
            ghost.finish()
            refused = None
        except Exception as e:
            refused = str(e)
        results.put(("prefill", rank, sum(s.bytes for s in stats), refused))
    else:  # a decode rank: its heads of every token
        r = rank - cp
        h0, h1 = dst.head_ranges[r]
        kv = [(torch.zeros(8, 16, h1 - h0, head_dim, dtype=torch.bfloat16),
               torch.zeros(8, 16, h1 - h0, head_dim, dtype=torch.bfloat16)) for _ in range(layers)]
        writer = KVReceiver(kv, lambda rid: dst.block_table if rid == "req" else None,
                            on_landed=(lambda rid: None) if land else None)  # nothing is freed here
        if land:
            writer.write_runs = refuse_writes
        receiver = TorchP2PReceiver(group, writer, sources=range(cp))
        assert receiver.wait_for([(s, "req") for s in range(cp)], timeout_s=60)
        for layer in range(layers):
            for t in range(tokens):
                slot = dst.block_table[t // 16], t % 16
                assert torch.equal(kv[layer][0][slot], truth[layer, 0, t, h0:h1])
                assert torch.equal(kv[layer][1][slot], truth[layer, 1, t, h0:h1])
        results.put(("decode", rank, sum(receiver.completed.values()), None))
    part_pair(group, cp)


def refuse_writes(*args, **kwargs):
    raise PieceRejected("this receiver takes landed KV only")


@pytest.mark.parametrize("cp,tp,land", [(1, 1, False), (2, 2, False), (1, 1, True), (1, 2, True)],
                         ids=["1x1", "2x2", "1x1-landed", "1x2-landed"])
def test_torch_p2p_moves_kv_bit_exactly_from_cp_ranks_to_tp_ranks(cp, tp, land):
    import torch.multiprocessing as mp

    from tests.test_allreduce import free_port

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(p2p_worker, args=(cp, tp, free_port(), results, land), nprocs=cp + tp)
    rows = [results.get() for _ in range(cp + tp)]
    sent = sum(b for role, _, b, _ in rows if role == "prefill")
    received = sum(b for role, _, b, _ in rows if role == "decode")
    heads_stored = 4 if tp == 2 else 3  # KV head 1 lives on both decode ranks
    assert sent == received == 2 * 2 * 45 * heads_stored * 8 * 2  # layers x (k, v) x tokens x heads x dim x bf16
    refusals = [reason for role, _, _, reason in rows if role == "prefill"]
    assert all(r is not None and "refused KV of 'ghost'" in r and "no KV reservation" in r for r in refusals)


def p2p_streams_worker(rank: int, port: int, results) -> None:
    """Rank 0 sends two requests whose layers interleave on one group, one of them with different runs per
    layer (the header goes again); rank 1 writes them."""
    from engine.parallel.groups import rendezvous, stateless_group
    from kvtransfer.torch_p2p import TorchP2PReceiver, TorchP2PSender

    group = stateless_group(rendezvous("127.0.0.1", port, rank, 2), "pair", rank, 2)
    data = torch.randn(2, 2, 2, 8, 3, 4, generator=torch.Generator().manual_seed(1))  # [request, layer, k/v, ...]
    runs = {("a", 0): [(0, 4), (4, 4)], ("a", 1): [(8, 8)], ("b", 0): [(16, 8)], ("b", 1): [(16, 8)]}
    if rank == 0:
        senders = {rid: TorchP2PSender(group, rid, 1) for rid in "ab"}
        for layer in range(2):
            for r, rid in enumerate("ab"):
                senders[rid].send_runs(layer, runs[rid, layer], data[r, layer, 0], data[r, layer, 1])
                senders[rid].flush()
        results.put(sum(s.finish().bytes for s in senders.values()))
    else:
        kv = [(torch.zeros(3, 16, 3, 4), torch.zeros(3, 16, 3, 4)) for _ in range(2)]
        receiver = TorchP2PReceiver(group, KVReceiver(kv, {"a": (0,), "b": (1,)}.get), sources=[0])
        assert receiver.wait_for([(0, "a"), (0, "b")], timeout_s=60)
        for layer in range(2):
            for which in range(2):
                flat = kv[layer][which].view(-1, 3, 4)
                for r, rid in enumerate("ab"):
                    assert torch.equal(flat[run_rows(runs[rid, layer])], data[r, layer, which])
        assert not flat[24:].any() and not receiver._streams  # nothing else written; every stream ended
        results.put(sum(receiver.completed.values()))
    part_pair(group, 1)


def test_torch_p2p_keeps_interleaved_requests_apart_and_follows_runs_that_change_between_layers():
    import torch.multiprocessing as mp

    from tests.test_allreduce import free_port

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(p2p_streams_worker, args=(free_port(), results), nprocs=2)
    assert results.get() == results.get() == 2 * 2 * 2 * 8 * 3 * 4 * 4  # requests x layers x k/v x rows x fp32


def p2p_announced_worker(rank: int, port: int, results) -> None:
    """Rank 0 pushes two prompts through `PlanSink`s whose layers interleave on one group, each announcing its
    three layers up front (one lands in decode's cache, one is buffered: its blocks are not in a row); then a
    push whose second layer breaks the run it announced; then one more push. Rank 1 receives them all. Each
    push has blocks of its own, as a decode instance's requests do (a later push lands while an earlier one
    is checked)."""
    from engine.parallel.groups import rendezvous, stateless_group
    from kvtransfer.torch_p2p import TorchP2PReceiver, TorchP2PSender

    group = stateless_group(rendezvous("127.0.0.1", port, rank, 2), "pair", rank, 2)
    layers, tokens, shape = 3, 40, (16, 16, 3, 4)  # 40 tokens: blocks 0-2 of the prefill cache
    truth = torch.randn(2, layers, 2, *shape, generator=torch.Generator().manual_seed(5))  # [prompt, layer, k/v]
    tables = {"in-a-row": (4, 5, 6), "scattered": (7, 1, 3), "broken": (8, 9, 10), "after": (12, 13, 14)}
    if rank == 0:
        def sink(rid: str) -> PlanSink:
            target = DecodeLayout(head_ranges=((0, 3),), block_size=16, block_table=tables[rid])
            return PlanSink(num_tokens=tokens, num_kv_heads=3, block_size=16, num_layers=layers, target=target,
                            senders=[TorchP2PSender(group, rid, 1)])

        sinks = [sink("in-a-row"), sink("scattered")]
        for layer in range(layers):
            for prompt, s in enumerate(sinks):
                s.push_layer(layer, *truth[prompt, layer], (0, 1, 2), KVStripe())
        outcomes = [s.finish().bytes for s in sinks]
        sender = TorchP2PSender(group, "broken", 1)
        sender.open(last_layer=2)
        rows = truth[0, 0, 0].view(-1, 3, 4)
        sender.send_runs(0, [(128, 40)], rows[:40], rows[:40])
        sender.send_runs(1, [(128, 20), (148, 20)], rows[:40], rows[:40])  # the same rows, other runs: a new run
        try:
            outcomes.append(sender.finish().bytes)
        except TransferError as e:
            outcomes.append(str(e))
        after = sink("after")
        for layer in range(layers):
            after.push_layer(layer, *truth[1, layer], (0, 1, 2), KVStripe())
        outcomes.append(after.finish().bytes)
        results.put(outcomes)
    else:
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(layers)]
        writer = KVReceiver(kv, tables.get, on_landed=lambda rid: None)
        receiver = TorchP2PReceiver(group, writer, sources=[0])
        assert receiver.wait_for([(0, "in-a-row"), (0, "scattered")], timeout_s=60)
        exact = all(torch.equal(kv[layer][which].view(-1, 3, 4)[run_rows([(b * 16, 16) for b in table])][:tokens],
                                truth[prompt, layer, which].view(-1, 3, 4)[:tokens])
                    for prompt, table in enumerate((tables["in-a-row"], tables["scattered"]))
                    for layer in range(layers) for which in range(2))
        assert receiver.wait_for([(0, "after")], timeout_s=60)
        exact_after = all(torch.equal(kv[layer][which].view(-1, 3, 4)[192:192 + tokens],
                                      truth[1, layer, which].view(-1, 3, 4)[:tokens])
                          for layer in range(layers) for which in range(2))
        with writer.lock:
            open_landings = sum(writer.landings(rid) for rid in tables)
        results.put((exact, exact_after, open_landings, len(receiver._streams)))
    part_pair(group, 1)


def sent_and_received(pair_worker) -> tuple:
    """`pair_worker(rank, port, results)` run on two spawned ranks: (what the sender put, a list; what the
    receiver put)."""
    import torch.multiprocessing as mp

    from tests.test_allreduce import free_port

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(pair_worker, args=(free_port(), results), nprocs=2)
    first, second = results.get(), results.get()
    return (first, second) if isinstance(first, list) else (second, first)


def test_torch_p2p_announced_layers_land_or_buffer_exactly_and_a_broken_run_is_refused_without_a_trace():
    sent, received = sent_and_received(p2p_announced_worker)
    layer_bytes = 2 * 40 * 3 * 4 * 4  # k/v x tokens x heads x dim x fp32
    assert sent[:2] == [3 * layer_bytes] * 2 and sent[3] == 3 * layer_bytes
    assert "refused KV of 'broken'" in sent[2] and "cut an announced run of layers short" in sent[2]
    assert received == (True, True, 0, 0)  # bit for bit; nothing left landing or held by the receiver


def p2p_dead_receiver_worker(rank: int, port: int, results) -> None:
    """Rank 1 dies after the first message it takes in; rank 0 keeps pushing layers (their sends in flight)."""
    import time

    from engine.parallel.groups import rendezvous, stateless_group
    from kvtransfer.torch_p2p import TorchP2PReceiver, TorchP2PSender

    group = stateless_group(rendezvous("127.0.0.1", port, rank, 2), "pair", rank, 2)
    if rank == 1:
        kv = [(torch.zeros(64, 16, 3, 64), torch.zeros(64, 16, 3, 64)) for _ in range(2)]
        receiver = TorchP2PReceiver(group, KVReceiver(kv, lambda rid: tuple(range(64))), sources=[0])
        while not receiver._written:
            time.sleep(0.001)
        os._exit(0)  # killed mid-push: no goodbye on the group
    sender = TorchP2PSender(group, "req", 1)
    keys = torch.randn(1024, 3, 64)
    try:
        for layer in range(200):
            sender.send_runs(layer % 2, [(16 * block, 16) for block in range(64)], keys, keys)
            sender.flush()
        sender.finish(timeout_s=30)
        results.put(("finished", None))
    except TransferError as e:
        results.put(("failed", str(e), sender.state.value, len(sender._in_flight)))


def test_torch_p2p_push_to_a_receiver_that_dies_mid_push_fails_and_holds_nothing():
    import torch.multiprocessing as mp

    from tests.test_allreduce import free_port

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(p2p_dead_receiver_worker, args=(free_port(), results), nprocs=2)
    outcome, message, state, in_flight = results.get()
    assert outcome == "failed" and "group rank 1" in message, message
    assert state == "failed" and in_flight == 0  # no send left holding its tensor


# ---- landing: a transport receives straight into the cache ------------------------------------------------


def landing_receiver(on_landed=lambda rid: None):
    kv = [(torch.zeros(4, 16, 3, 8), torch.zeros(4, 16, 3, 8)) for _ in range(2)]
    tables = {"r": (1, 2)}
    return kv, tables, KVReceiver(kv, tables.get, on_landed=on_landed)


def test_a_piece_lands_in_the_slots_its_runs_name_and_only_while_the_receiver_allows_it():
    kv, tables, receiver = landing_receiver()
    keys, values = torch.randn(2, 20, 3, 8)
    with receiver.landing("r", range(1, 2), [(16, 8), (24, 12)], (20, 3, 8), torch.float32) as landed:
        assert receiver.landings("r") == 1
        (views,) = landed
        views[0].copy_(keys)  # what a transport's receive does
        views[1].copy_(values)
    assert receiver.landings("r") == 0
    assert torch.equal(kv[1][0].view(-1, 3, 8)[16:36], keys) and torch.equal(kv[1][1].view(-1, 3, 8)[16:36], values)
    assert not kv[1][0].view(-1, 3, 8)[36:].any() and not kv[0][0].any()  # nothing else written
    with receiver.landing("r", range(1, 2), [(16, 4), (32, 4)], (8, 3, 8), torch.float32) as views:
        assert views is None  # two ranges: the transport receives elsewhere and writes
    _, _, buffered_only = landing_receiver(on_landed=None)
    with buffered_only.landing("r", range(2), [(16, 4)], (4, 3, 8), torch.float32) as views:
        assert views is None  # an owner that cannot hold blocks back does not let KV land


@pytest.mark.parametrize("request_id,layers,runs,shape,error", [
    ("ghost", range(2), [(16, 4)], (4, 3, 8), "no KV reservation"),
    ("r", range(2), [(40, 10)], (10, 3, 8), "not inside blocks reserved"),
    ("r", range(2), [(16, 4)], (4, 2, 8), r"pieces must be \[4, 3, 8\] torch.float32"),
    ("r", range(1, 3), [(16, 4)], (4, 3, 8), r"layer 2 is out of range \[0, 2\)"),
])
def test_a_landing_outside_its_reservation_or_of_the_wrong_shape_is_refused_before_any_view(request_id, layers, runs,
                                                                                            shape, error):
    _, _, receiver = landing_receiver()
    with pytest.raises((PieceRejected, NoReservation), match=error):
        with receiver.landing(request_id, layers, runs, shape, torch.float32):
            pytest.fail("a refused piece got views of the cache")
    assert receiver.landings(request_id) == 0


def test_a_reservation_that_ends_mid_landing_is_told_when_the_landing_closes_even_when_it_fails():
    landed = []
    _, tables, receiver = landing_receiver(on_landed=landed.append)
    with pytest.raises(RuntimeError, match="the peer died"):
        with receiver.landing("r", range(1), [(16, 4)], (4, 3, 8), torch.float32):
            with receiver.lock:  # the owner ends the reservation (a cancel) while KV lands
                del tables["r"]
                assert receiver.landings("r") == 1  # so it holds the blocks back
            assert landed == []
            raise RuntimeError("the peer died")  # the receive fails
    assert landed == ["r"] and receiver.landings("r") == 0
    tables["r"] = (1, 2)
    with receiver.landing("r", range(1), [(16, 4)], (4, 3, 8), torch.float32):
        pass
    assert landed == ["r"]  # a landing that closes while its reservation lives is nobody's business


def p2p_idle_worker(rank: int, port: int, results) -> None:
    """Rank 0 pushes, stays silent past the group's 2 s operation timeout (a prefill between requests), and
    pushes again. The group is formed as decode's pair groups are: its idle waits are a year."""
    import datetime

    from engine.parallel.groups import IDLE, rendezvous, stateless_group
    from kvtransfer.torch_p2p import TorchP2PReceiver, TorchP2PSender

    group = stateless_group(rendezvous("127.0.0.1", port, rank, 2), "pair", rank, 2,
                            timeout=datetime.timedelta(seconds=2), idle_timeout=IDLE)
    tables = {"before": (0,), "after": (1,)}
    if rank == 0:
        sent = []
        for request_id, pause in (("before", 4), ("after", 0)):
            keys = torch.full((16, 3, 8), float(tables[request_id][0] + 1))
            sender = TorchP2PSender(group, request_id, 1)
            sender.send_runs(0, [(16 * tables[request_id][0], 16)], keys, -keys)
            sent.append(sender.finish().bytes)
            time.sleep(pause)
        results.put(sent)
    else:
        kv = [(torch.zeros(2, 16, 3, 8), torch.zeros(2, 16, 3, 8))]
        receiver = TorchP2PReceiver(group, KVReceiver(kv, tables.get), sources=[0])
        arrived = receiver.wait_for([(0, "before"), (0, "after")], timeout_s=30)
        results.put((arrived, kv[0][0][:, 0, 0, 0].tolist(), kv[0][1][:, 0, 0, 0].tolist()))
    part_pair(group, 1)


def test_a_pair_silent_past_its_operation_timeout_still_carries_the_next_push():
    sent, received = sent_and_received(p2p_idle_worker)
    assert sent == [2 * 16 * 3 * 8 * 4] * 2
    assert received == (True, [1.0, 2.0], [-1.0, -2.0])


def p2p_dying_sender_worker(rank: int, port: int, results, die) -> None:
    """Rank 0 sends a layer's descriptor and header, then dies before its payload; rank 1 is landing it, and
    its owner ends the reservation meanwhile. The group waits a year for a message, as decode's pair groups do:
    the receiver learns of the death from the connection, not a timeout."""
    from engine.parallel.groups import IDLE, rendezvous, stateless_group
    from kvtransfer.torch_p2p import DTYPE_CODES, TAG_DESCRIPTOR, TAG_HEADER, Kind, TorchP2PReceiver, _header

    group = stateless_group(rendezvous("127.0.0.1", port, rank, 2), "pair", rank, 2, idle_timeout=IDLE)
    if rank == 0:
        header = _header("r", [(16, 4)])
        group.send([torch.tensor([Kind.DATA, 0, 0, header.numel(), DTYPE_CODES[torch.float32], 4, 3, 8, 0])], 1,
                   TAG_DESCRIPTOR).wait()
        group.send([header], 1, TAG_HEADER).wait()
        die.wait(60)
        os._exit(0)  # killed mid-message: no goodbye on the group
    landed, exited = [], threading.Event()
    _, tables, writer = landing_receiver(on_landed=landed.append)
    TorchP2PReceiver(group, writer, sources=[0], on_exit=exited.set)
    deadline = time.monotonic() + 60
    while not writer.landings("r") and time.monotonic() < deadline:
        time.sleep(0.01)
    with writer.lock:
        open_landings = writer.landings("r")
        del tables["r"]  # a cancel while the payload is awaited
    die.set()
    results.put((open_landings, exited.wait(60), landed, writer.landings("r")))


def test_a_sender_that_dies_mid_landing_closes_the_landing_and_tells_the_owner():
    import torch.multiprocessing as mp

    from tests.test_allreduce import free_port

    context = mp.get_context("spawn")
    results, die = context.SimpleQueue(), context.Event()
    workers = mp.start_processes(p2p_dying_sender_worker, args=(free_port(), results, die), nprocs=2, join=False,
                                 start_method="spawn")
    open_landings, exited, landed, landings_after = results.get()
    for process in workers.processes:
        process.join(30)
    assert open_landings == 1  # the payload was being received straight into the cache
    assert exited and landed == ["r"] and landings_after == 0  # the failed receive closed it: the blocks may go


def p2p_late_receiver_worker(rank: int, port: int, results) -> None:
    """Rank 0 pushes one layer (the step's last) from views of its cache, then reuses the cache at once; rank 1
    starts receiving a second later."""
    from engine.kv_cache import KVStripe
    from engine.parallel.groups import rendezvous, stateless_group
    from kvtransfer.torch_p2p import TorchP2PReceiver, TorchP2PSender

    group = stateless_group(rendezvous("127.0.0.1", port, rank, 2), "pair", rank, 2)
    tokens, shape = 2048, (128, 16, 8, 128)  # 8 MB of keys and of values: more than the socket holds
    truth = torch.randn(2, *shape, generator=torch.Generator().manual_seed(3))
    table = tuple(range(tokens // 16))
    if rank == 0:
        cache = truth.clone()
        target = DecodeLayout(head_ranges=((0, 8),), block_size=16, block_table=table)
        sink = PlanSink(num_tokens=tokens, num_kv_heads=8, block_size=16, num_layers=1, target=target,
                        senders=[TorchP2PSender(group, "r", 1)])
        sink.push_layer(0, cache[0], cache[1], table, KVStripe())
        cache.fill_(float("nan"))  # the step ended: its blocks go to the next prompt
        results.put(sink.finish().bytes)
    else:
        time.sleep(1.0)
        kv = [(torch.zeros(shape), torch.zeros(shape))]
        receiver = TorchP2PReceiver(group, KVReceiver(kv, lambda rid: table, on_landed=lambda rid: None), sources=[0])
        assert receiver.wait_for([(0, "r")], timeout_s=60)
        results.put(torch.equal(kv[0][0], truth[0]) and torch.equal(kv[0][1], truth[1]))
    part_pair(group, 1)


def test_a_push_from_views_of_the_cache_is_sent_before_the_step_that_made_it_ends():
    import torch.multiprocessing as mp

    from tests.test_allreduce import free_port

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(p2p_late_receiver_worker, args=(free_port(), results), nprocs=2)
    outcomes = {results.get(), results.get()}
    assert outcomes == {True, 2 * 8 << 20}  # bit for bit, though the cache was reused right after the last layer


def test_a_push_from_a_shared_cache_is_read_by_decode_before_the_step_that_made_it_ends():
    """Decode copies the layer out of prefill's cache in shared memory (slowly here); prefill reuses its cache
    right after the step's last layer."""
    shape = (128, 16, 4, 32)
    truth = torch.randn(2, *shape, generator=torch.Generator().manual_seed(4))
    source = [(shm_arena.shared_zeros(shape, torch.float32), shm_arena.shared_zeros(shape, torch.float32))]
    source[0][0].copy_(truth[0])
    source[0][1].copy_(truth[1])
    kv = [(torch.zeros(shape), torch.zeros(shape))]
    table = tuple(range(16, 32))

    def reserved(request_id: str):
        time.sleep(0.3)  # a decode rank busy elsewhere
        return table

    endpoint = shared_memory.Endpoint(0, 1, KVReceiver(kv, reserved), links=None, shared_address=None)
    try:
        sink = PlanSink(num_tokens=256, num_kv_heads=4, block_size=16, num_layers=1,
                        target=DecodeLayout(head_ranges=((0, 4),), block_size=16, block_table=table),
                        senders=[shared_memory.SharedMemorySender(endpoint.address, "r", 0)])
        sink.push_layer(0, *source[0], tuple(range(16)), KVStripe())
        for cache in source[0]:
            cache.fill_(float("nan"))  # the step ended: its blocks go to the next prompt
        assert sink.finish().bytes == 2 * 256 * 4 * 32 * 4
        assert torch.equal(kv[0][0][16:32], truth[0][:16]) and torch.equal(kv[0][1][16:32], truth[1][:16])
    finally:
        endpoint.stop()


class CountingSender(shared_memory.SharedMemorySender):
    """Counts the messages it puts on the stream."""

    def _post(self, message: bytes) -> None:
        self.messages = getattr(self, "messages", 0) + 1
        super()._post(message)


def test_layers_read_from_a_shared_cache_go_out_a_batch_a_message_and_land_exactly(monkeypatch):
    layers, shape = 5, (8, 16, 2, 32)  # 32 KB of keys and of values a layer
    monkeypatch.setattr(shared_memory, "BATCH_BYTES", 2 * 2 * 32 << 10)  # two layers a message
    truth = torch.randn(layers, 2, *shape, generator=torch.Generator().manual_seed(6))
    source = [tuple(shm_arena.shared_zeros(shape, torch.float32).copy_(truth[i, j]) for j in range(2))
              for i in range(layers)]
    kv = [(torch.zeros(16, 16, 2, 32), torch.zeros(16, 16, 2, 32)) for _ in range(layers)]
    endpoint = shared_memory.Endpoint(0, 1, KVReceiver(kv, lambda rid: tuple(range(16))), links=None,
                                      shared_address=None)
    runs = [[(0, 128)]] + [[(0, 64), (128, 64)]] * 4  # the runs change at layer 1: a new message
    try:
        sender = CountingSender(endpoint.address, "r", 0)
        for layer, (k, v) in enumerate(source):
            sender.send_runs(layer, runs[layer], k.view(-1, 2, 32), v.view(-1, 2, 32))
            sender.flush()
        stats = sender.finish(timeout_s=30)
        assert sender.messages == 3 and stats.bytes == layers * 2 * 128 * 2 * 32 * 4  # [0], [1, 2], [3, 4]
        for layer in range(layers):
            for got, want in zip(kv[layer], truth[layer]):
                rows, want = got.view(-1, 2, 32), want.view(-1, 2, 32)
                assert torch.equal(rows[run_rows(runs[layer])], want) and not rows[192:].any()
    finally:
        endpoint.stop()


def test_a_grpc_stream_refuses_more_layers_than_it_carries(pair):
    _, decode, channel, _, _ = pair
    decode.reserve("r", [5] * 10, GREEDY)
    slot = decode._sequences["r"].block_table[0] * 16
    piece = internal_pb2.KVPiece(request_id="r", layer=0, dst_slots=[slot], run_tokens=[1],
                                 dtype=internal_pb2.DTYPE_FLOAT32, keys=bytes(256), values=bytes(256),
                                 more_layers=[internal_pb2.KVLayerRef(layer=1)])
    with pytest.raises(grpc.RpcError) as refused:
        internal_pb2_grpc.KVTransferStub(channel).Push(iter([piece]), timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "more_layers are for the shared_memory transport" in refused.value.details()
