"""KV transfer over a gRPC client stream (works everywhere): `KVTransfer.Push`, one stream per
(request, destination rank) and one message per layer (all its pieces for that rank: a 2,048-token
prompt is 30 messages, not 3,840); the destination rank's server writes the pieces into its cache and
answers once the stream ends, which is the acknowledgement `finish` waits for. The sender writes each
message's wire bytes itself (`wire_message`): protobuf's encoder copies a big bytes field at ~1.4 GB/s; the
server takes each message's bytes as they came and views the keys and values in them (`read_piece`), where
protobuf's parser and its accessors would copy them three times.

The transport entry `grpc_stream` (`kvtransfer.transports`): each decode rank serves `KVTransfer` on a
server of its own; a prefill rank opens one stream per decode rank over its service's pooled channels."""

from __future__ import annotations

import contextlib
import queue
import warnings
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError

from kvtransfer.transport import KVReceiver, KVSender, PieceRejected, TransferError
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc

WIRE_DTYPES = {torch.float32: internal_pb2.DTYPE_FLOAT32, torch.bfloat16: internal_pb2.DTYPE_BFLOAT16,
          torch.float16: internal_pb2.DTYPE_FLOAT16}
DTYPES_BY_WIRE = {v: k for k, v in WIRE_DTYPES.items()}
_END = object()
# a message's keys and values are viewed in place (immutable bytes) and only read from: torch need not warn
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is a contiguous host tensor (a CUDA cache's pieces come to
    the host)."""
    return t.contiguous().view(torch.uint8).cpu().numpy().data


KEYS_FIELD = internal_pb2.KVPiece.DESCRIPTOR.fields_by_name["keys"].number
VALUES_FIELD = internal_pb2.KVPiece.DESCRIPTOR.fields_by_name["values"].number


def wire_message(piece: internal_pb2.KVPiece, keys: torch.Tensor, values: torch.Tensor) -> bytes:
    """`piece` serialized with `keys` and `values` as its `keys` and `values` fields: the small fields by
    protobuf, the two tensors appended as length-delimited fields (the bytes protobuf would write, which a
    parser reads the same in any field order), 6x faster for a 1.6 MB layer."""
    head = piece.SerializeToString()
    k, v = tensor_buffer(keys), tensor_buffer(values)  # joined straight from the tensors: one copy
    return b"".join([head, _field_prefix(KEYS_FIELD, k.nbytes), k, _field_prefix(VALUES_FIELD, v.nbytes), v])


def piece_head(request_id: str, dst_rank: int, layer: int, runs: list[tuple[int, int]],
               dtype: torch.dtype) -> internal_pb2.KVPiece:
    """A layer's `KVPiece` for `dst_rank` without its keys and values: `runs` of (first slot, tokens)."""
    return internal_pb2.KVPiece(request_id=request_id, layer=layer, dst_rank=dst_rank,
                                dst_slots=[slot for slot, _ in runs], run_tokens=[n for _, n in runs],
                                dtype=WIRE_DTYPES[dtype])


@dataclass(frozen=True, slots=True)
class WirePiece:
    """A `KVPiece` as it came off the wire: `head` its other fields, parsed; `keys` and `values` its two
    tensors' bytes, views of the message (empty when it carries none)."""

    head: internal_pb2.KVPiece
    keys: memoryview
    values: memoryview


def read_piece(data: bytes) -> WirePiece:
    """`wire_message` undone, for any field order: the top-level fields are walked, `keys` and `values` viewed
    where they lie (the last of each, as protobuf's parser keeps it) and the rest parsed by protobuf. Three
    copies of a 1.6 MB layer fewer than `KVPiece.FromString` and its accessors. PieceRejected if malformed."""
    view, head, payload, pos = memoryview(data), [], {}, 0
    while pos < len(data):
        start = pos
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            pos += length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise PieceRejected(f"KVPiece field {number} has wire type {wire_type}, which it never carries")
        if pos > len(data):
            raise PieceRejected(f"KVPiece is truncated: field {number} ends at byte {pos} of {len(data)}")
        if wire_type == 2 and number in (KEYS_FIELD, VALUES_FIELD):
            payload[number] = view[pos - length:pos]
        else:
            head.append(view[start:pos])
    try:
        parsed = internal_pb2.KVPiece.FromString(b"".join(head))
    except DecodeError as e:
        raise PieceRejected(f"KVPiece does not parse: {e}") from None
    return WirePiece(parsed, payload.get(KEYS_FIELD, view[:0]), payload.get(VALUES_FIELD, view[:0]))


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` and where it ends."""
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos
    raise PieceRejected(f"KVPiece has a malformed or truncated varint before byte {pos} of {len(data)}")


def add_to_server(service: KVTransferService, server: grpc.Server) -> None:
    """`service` on `server` (as `internal_pb2_grpc.add_KVTransferServicer_to_server`), its pieces handed over
    as the bytes that came (`read_piece` reads them)."""
    push = grpc.stream_unary_rpc_method_handler(service.Push, request_deserializer=None,
                                                response_serializer=internal_pb2.PushResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("infermesh.v1.KVTransfer",
                                                                          {"Push": push}),))


def _field_prefix(number: int, length: int) -> bytes:
    """The key (field number, wire type 2) and varint length of a length-delimited field."""
    out = bytearray()
    for varint in (number << 3 | 2, length):
        while varint >= 0x80:
            out.append(varint & 0x7F | 0x80)
            varint >>= 7
        out.append(varint)
    return bytes(out)


class GrpcStreamSender(KVSender):
    def __init__(self, channel: grpc.Channel, request_id: str, dst_rank: int, *, timeout_s: float = 60.0) -> None:
        super().__init__()
        self.request_id, self.dst_rank, self.timeout_s = request_id, dst_rank, timeout_s
        self._push = channel.stream_unary("/infermesh.v1.KVTransfer/Push", request_serializer=None,  # wire bytes
                                          response_deserializer=internal_pb2.PushResponse.FromString)
        self._queue: queue.Queue = queue.Queue(maxsize=8)  # bounded: a slow receiver slows the sender
        self._call = None

    def _requests(self):
        while (item := self._queue.get()) is not _END:
            yield item

    def _put(self, item) -> None:
        while True:
            if self._call.done():
                self._raise_from_call()
                raise TransferError(f"KV push to rank {self.dst_rank} ended early")
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _send_layer(self, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor) -> None:
        head = piece_head(self.request_id, self.dst_rank, layer, runs, keys.dtype)
        self._post(wire_message(head, keys, values))

    def _post(self, message: bytes) -> None:
        """One serialised `KVPiece` onto the stream (opened by the first)."""
        if self._call is None:
            self._call = self._push.future(self._requests(), timeout=self.timeout_s)
        self._put(message)

    def _finish(self, timeout_s: float) -> None:
        if self._call is None:
            return  # nothing to send to this rank
        self._put(_END)
        try:
            self._call.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            self._call.cancel()
            raise TransferError(f"KV push to rank {self.dst_rank} not acknowledged within {timeout_s} s") from None
        except grpc.RpcError:
            self._raise_from_call()

    def _raise_from_call(self) -> None:
        error = self._call.exception()
        if error is not None:
            raise TransferError(f"KV push to rank {self.dst_rank} failed: {error.code().name}: {error.details()}")


class Dialer:
    """A prefill rank's streams to decode ranks, over the service's pooled channels."""

    def __init__(self, rank: int, ranks: int, links) -> None:
        self.links = links

    def prepare(self, addresses: tuple[str, ...]) -> int:
        return 0  # nothing to set up ahead of a push

    def senders(self, addresses: tuple[str, ...], link: int, request_id: str, timeout_s: float) -> list[KVSender]:
        return [GrpcStreamSender(self.links.channel(a), request_id, r, timeout_s=timeout_s)
                for r, a in enumerate(addresses)]

    def close(self) -> None:
        pass  # the channels are the service's


def shared(host: str) -> None:
    return None  # every decode rank serves on its own


class KVTransferService(internal_pb2_grpc.KVTransferServicer):
    """Served by each decode rank, writing into that rank's cache. A refused piece ends the stream with
    the refusal (NOT_FOUND for an unknown reservation, INVALID_ARGUMENT otherwise, at the gRPC edge)."""

    def __init__(self, receiver: KVReceiver, rank: int = 0) -> None:
        self.receiver, self.rank = receiver, rank

    def Push(self, request_iterator, context):
        """`request_iterator`: each piece's bytes (`add_to_server`)."""
        total = pieces = 0
        with self.reader() as tensors:
            for data in request_iterator:
                piece = read_piece(data)
                msg = piece.head
                if msg.dst_rank != self.rank:
                    raise PieceRejected(f"piece for rank {msg.dst_rank} sent to rank {self.rank}")
                if len(msg.dst_slots) != len(msg.run_tokens):
                    raise PieceRejected(f"{len(msg.dst_slots)} dst_slots for {len(msg.run_tokens)} run_tokens")
                runs = list(zip(msg.dst_slots, msg.run_tokens))
                for layer, keys, values in tensors(piece, *self._layout(msg)):
                    total += self.receiver.write_runs(msg.request_id, layer, runs, keys, values)
                    pieces += 1
        return internal_pb2.PushResponse(bytes=total, pieces=pieces)

    def _layout(self, msg) -> tuple[torch.dtype, tuple[int, int, int], int]:
        """dtype, shape and bytes of each of the message's two tensors."""
        dtype = DTYPES_BY_WIRE.get(msg.dtype)
        if dtype is None:
            raise PieceRejected(f"dtype {msg.dtype} is not one of float32, bfloat16, float16")
        shape = (sum(msg.run_tokens), self.receiver.num_heads, self.receiver.head_dim)
        return dtype, shape, shape[0] * shape[1] * shape[2] * dtype.itemsize

    @contextlib.contextmanager
    def reader(self):
        """For one stream: `tensors(piece, dtype, shape, size)` -> the `WirePiece`'s (layer, keys, values)."""
        def tensors(piece, dtype, shape, size):
            if piece.head.more_layers:
                raise PieceRejected("more_layers are for the shared_memory transport")
            for data in (piece.keys, piece.values):
                if len(data) != size:
                    raise PieceRejected(f"pieces of {shape[0]} tokens must carry {size} bytes per tensor, "
                                        f"got {len(data)}")
            return [(piece.head.layer, *(torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)  # read only
                                         for data in (piece.keys, piece.values)))]

        yield tensors


class Endpoint:
    """A decode rank's `KVTransfer` server (on the service's host, any free port)."""

    def __init__(self, rank: int, ranks: int, receiver: KVReceiver, links, shared_address: str | None) -> None:
        self.address = links.serve([(add_to_server, KVTransferService(receiver, rank), "infermesh.v1.KVTransfer")])

    def stop(self) -> None:
        pass  # the server is the service's: it stops with it
