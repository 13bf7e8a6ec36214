"""KV transfer over a gRPC client stream (works everywhere): `KVTransfer.Push`, one stream per
(request, destination rank) and one message per layer (all its pieces for that rank: a 2,048-token
prompt is 30 messages, not 3,840); the destination rank's server writes the pieces into its cache and
answers once the stream ends, which is the acknowledgement `finish` waits for.

The transport entry `grpc_stream` (`kvtransfer.transports`): each decode rank serves `KVTransfer` on a
server of its own; a prefill rank opens one stream per decode rank over its service's pooled channels."""

from __future__ import annotations

import queue

import grpc
import torch

from kvtransfer.transport import KVReceiver, KVSender, PieceRejected, TransferError
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc

WIRE_DTYPES = {torch.float32: internal_pb2.DTYPE_FLOAT32, torch.bfloat16: internal_pb2.DTYPE_BFLOAT16,
          torch.float16: internal_pb2.DTYPE_FLOAT16}
DTYPES_BY_WIRE = {v: k for k, v in WIRE_DTYPES.items()}
_END = object()


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()  # a CUDA cache's pieces come to the host


class GrpcStreamSender(KVSender):
    def __init__(self, channel: grpc.Channel, request_id: str, dst_rank: int, *, timeout_s: float = 60.0) -> None:
        super().__init__()
        self.request_id, self.dst_rank, self.timeout_s = request_id, dst_rank, timeout_s
        self._stub = internal_pb2_grpc.KVTransferStub(channel)
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
        if self._call is None:
            self._call = self._stub.Push.future(self._requests(), timeout=self.timeout_s)
        self._put(internal_pb2.KVPiece(request_id=self.request_id, layer=layer, dst_rank=self.dst_rank,
                                       dst_slots=[slot for slot, _ in runs], run_tokens=[n for _, n in runs],
                                       dtype=WIRE_DTYPES[keys.dtype], keys=tensor_bytes(keys),
                                       values=tensor_bytes(values)))

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


class Endpoint:
    """A decode rank's `KVTransfer` server (on the service's host, any free port)."""

    def __init__(self, rank: int, ranks: int, receiver: KVReceiver, links, shared_address: str | None) -> None:
        self.address = links.serve([(internal_pb2_grpc.add_KVTransferServicer_to_server,
                                     KVTransferService(receiver, rank), "infermesh.v1.KVTransfer")])

    def stop(self) -> None:
        pass  # the server is the service's: it stops with it


class KVTransferService(internal_pb2_grpc.KVTransferServicer):
    """Served by each decode rank, writing into that rank's cache. A refused piece ends the stream with
    the refusal (NOT_FOUND for an unknown reservation, INVALID_ARGUMENT otherwise, at the gRPC edge)."""

    def __init__(self, receiver: KVReceiver, rank: int = 0) -> None:
        self.receiver, self.rank = receiver, rank

    def Push(self, request_iterator, context):
        total = pieces = 0
        for msg in request_iterator:
            if msg.dst_rank != self.rank:
                raise PieceRejected(f"piece for rank {msg.dst_rank} sent to rank {self.rank}")
            if len(msg.dst_slots) != len(msg.run_tokens):
                raise PieceRejected(f"{len(msg.dst_slots)} dst_slots for {len(msg.run_tokens)} run_tokens")
            keys, values = (self._tensor(data, msg) for data in (msg.keys, msg.values))
            row = 0
            for slot, n in zip(msg.dst_slots, msg.run_tokens):
                total += self.receiver.write(msg.request_id, msg.layer, slot, keys[row:row + n], values[row:row + n])
                row += n
            pieces += 1
        return internal_pb2.PushResponse(bytes=total, pieces=pieces)

    def _tensor(self, data: bytes, msg) -> torch.Tensor:
        dtype = DTYPES_BY_WIRE.get(msg.dtype)
        if dtype is None:
            raise PieceRejected(f"dtype {msg.dtype} is not one of float32, bfloat16, float16")
        shape = (sum(msg.run_tokens), self.receiver.num_heads, self.receiver.head_dim)
        expected = shape[0] * shape[1] * shape[2] * torch.tensor([], dtype=dtype).element_size()
        if len(data) != expected:
            raise PieceRejected(f"pieces of {shape[0]} tokens must carry {expected} bytes per tensor, got {len(data)}")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)
