"""KV transfer through shared memory, for a prefill and a decode instance on one host: messages of the
`grpc_stream` protocol that say where each layer's keys and values lie instead of carrying them, over a Unix
socket (`local_socket`: a fifth of a gRPC stream's latency, which was a third of a push).

A prefill rank gathers each layer's keys and values for a decode rank straight into a region of its
process's staging file in /dev/shm (`shm_arena`: mapped once, regions reused push after push); the
layer's `KVPiece` names the file and the offsets. The decode rank maps the file read-only for the stream
and copies each layer from there into its cache through the same checks as every transport
(`KVReceiver`): one copy on each side, no serialisation, no page faults once the arena is warm. The
regions go back to the arena when decode acknowledged the push; a failed push's regions are discarded
(their pages freed, their offsets not reused for ten minutes), so a late reader sees zeros, not another
push.

One copy in all where the prefill instance holds its KV cache in the arena (`shm_arena.shared_zeros`,
`--shared-kv-cache`) and a layer's rows are one range of it: the piece names where they lie in the
cache, and decode copies them from there. Such layers go out together, about `BATCH_BYTES` a message
(`KVPiece.more_layers`: a push of 2,048 SmolLM2 tokens is three messages, not thirty). The cache's
blocks may be reused once the step that pushed ends, so such a sender waits at the step's last layer
(`settle`) until decode acknowledged the push: at most a batch of copying.

Each decode rank's endpoint is a socket in /dev/shm (its address is the path), open to its user's
processes only. The staging file and the socket are named after their process and removed when it exits;
those of a process that was killed are removed by the next sender on the host (`sweep`). A path that is not
one of ours in /dev/shm is refused, and a prefill rank on another host cannot reach the socket: the push
fails and decode recomputes the prompt, so pick this transport for prefill and decode instances that share a
host. A refusal names its type (`NoReservation`, `PieceRejected`, ...), as `engine.errors` has it.

The transport entry `shared_memory` (`kvtransfer.transports`).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import stat
import threading
import warnings

import torch

from kvtransfer import grpc_stream, local_socket
from kvtransfer.grpc_stream import piece_head
from kvtransfer.shm_arena import PREFIX, SHM_DIR, Region, alive, arena, owner_pid, sweep
from kvtransfer.transport import CPU, KVReceiver, KVSender, PieceRejected, TransferError, TransferState, TransferStats
from protos.infermesh.v1 import internal_pb2

# decode maps the sender's file read-only and only reads from it: torch need not warn
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)
BATCH_BYTES = 16 << 20  # layers read from the cache, per message


class SharedMemorySender(KVSender):
    """One request's push to the decode rank whose socket is at `address`."""

    def __init__(self, address: str, request_id: str, dst_rank: int, *, timeout_s: float = 60.0) -> None:
        super().__init__()
        self.address, self.request_id, self.dst_rank, self.timeout_s = address, request_id, dst_rank, timeout_s
        self._connection: local_socket.Connection | None = None  # opened by the first message
        self._regions: list[Region] = []
        self._reads_cache = False  # a piece names the prefill's cache itself: decode must read it before reuse
        self._stats: TransferStats | None = None  # the push, acknowledged at `settle`
        self._batch: list[tuple[int, int, int]] = []  # (layer, keys offset, values offset) in the cache, unsent
        self._batch_runs: list[tuple[int, int]] = []
        self._batch_bytes, self._batch_dtype = 0, torch.float32

    @property
    def path(self) -> str:
        return arena().path

    def layer_buffers(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device = CPU):
        """A region of the arena for one layer: the sink gathers keys and values into it, `_piece` sends
        them as they lie. None when this push failed or /dev/shm is full (`_piece` then reports it)."""
        if self.state is TransferState.FAILED:
            return None
        try:
            kv = self._take(2 * math.prod(shape) * dtype.itemsize).view(dtype).view(2, *shape)
        except TransferError:
            return None
        return kv[0], kv[1]

    def _take(self, nbytes: int) -> torch.Tensor:
        try:
            region = arena().take(nbytes)
        except OSError as e:
            raise TransferError(f"cannot stage {nbytes} bytes of KV in {SHM_DIR}: {e.strerror}") from None
        self._regions.append(region)
        return region.tensor[:nbytes]

    def _send_layer(self, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor) -> None:
        offsets = [arena().owns(t) if t.is_contiguous() else None for t in (keys, values)]
        if None in offsets or any(r.offset <= offsets[0] < r.offset + r.size for r in self._regions):
            head = piece_head(self.request_id, self.dst_rank, layer, runs, keys.dtype)
            self._post(self._piece(head, keys, values))  # gathered into a region, or staged now
            return
        if self._batch and runs != self._batch_runs:
            self._send_batch()
        self._reads_cache = True
        self._batch.append((layer, *offsets))
        self._batch_runs, self._batch_dtype = runs, keys.dtype
        self._batch_bytes += 2 * keys.numel() * keys.element_size()
        if self._batch_bytes >= BATCH_BYTES:
            self._send_batch()

    def _send_batch(self) -> None:
        """The layers read from the cache so far, as one message."""
        if not self._batch:
            return
        (layer, keys, values), *more = self._batch
        piece = piece_head(self.request_id, self.dst_rank, layer, self._batch_runs, self._batch_dtype)
        piece.shm_path, piece.shm_offset, piece.shm_values_offset = self.path, keys, values
        piece.more_layers.extend(internal_pb2.KVLayerRef(layer=layer, keys_offset=keys, values_offset=values)
                                 for layer, keys, values in more)
        self._batch, self._batch_bytes = [], 0
        self._post(piece.SerializeToString())

    def _post(self, message: bytes) -> None:
        """One serialised `KVPiece` to decode (the first opens the connection)."""
        if self._connection is None:
            self._connection = local_socket.Connection(self.address, self.timeout_s, f"KV push to rank {self.dst_rank}")
        self._connection.send(message)

    def _piece(self, piece: internal_pb2.KVPiece, keys: torch.Tensor, values: torch.Tensor) -> bytes:
        """The layer's message, its keys and values staged in the arena unless they lie there."""
        if arena().owns(keys) is None or not (keys.is_contiguous() and values.is_contiguous()):
            staged = self._take(2 * keys.numel() * keys.element_size()).view(keys.dtype).view(2, *keys.shape)
            staged[0].copy_(keys)
            staged[1].copy_(values)
            keys, values = staged
        piece.shm_path, piece.shm_offset, piece.shm_values_offset = self.path, arena().owns(keys), arena().owns(values)
        return piece.SerializeToString()

    def _finish(self, timeout_s: float) -> None:
        self._send_batch()
        if self._connection is not None:  # else nothing was sent to this rank
            self._connection.finish(timeout_s)

    def settle(self) -> None:
        """Decode reads pieces straight from the cache: wait for its acknowledgement (a failure leaves this
        sender FAILED: `finish` raises it)."""
        if self._reads_cache and self.state is TransferState.TRANSFERRING:
            with contextlib.suppress(TransferError):
                self._stats = self.finish(self.timeout_s)

    def finish(self, timeout_s: float = 60.0):
        if self._stats is not None:
            return self._stats  # acknowledged at `settle`
        try:
            return super().finish(timeout_s)
        finally:  # acknowledged: the regions serve the next push; failed: decode may still read, so quarantine
            if self._connection is not None:
                self._connection.close()  # a push failed on this side ends on decode's at once
            keep = self.state is TransferState.DONE
            for region in self._regions:
                (arena().give_back if keep else arena().discard)(region)
            self._regions.clear()


class SharedMemoryService(grpc_stream.KVTransferService):
    """Maps each sender's file once (a fresh mapping faults its pages in again) and keeps it while the
    sender's process lives."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._files: dict[str, torch.Tensor] = {}  # path -> its bytes, mapped read-only
        self._lock = threading.Lock()

    def _file(self, path: str) -> torch.Tensor:
        with self._lock:
            data = self._files.get(path)
            if data is None:
                for gone in [p for p in self._files if not alive(owner_pid(p))]:
                    del self._files[gone]  # unmapped with the last view: its pages go back to the host
                data = self._files[path] = _map(path)
            return data

    @contextlib.contextmanager
    def reader(self):
        def tensors(piece, dtype, shape, size):
            msg = piece.head
            data = self._file(msg.shm_path)
            values_offset = msg.shm_values_offset if msg.HasField("shm_values_offset") else msg.shm_offset + size
            layers = [(msg.layer, ("shm_offset", msg.shm_offset), ("shm_values_offset", values_offset))]
            layers += [(ref.layer, (f"more_layers[{i}].keys_offset", ref.keys_offset),
                        (f"more_layers[{i}].values_offset", ref.values_offset))
                       for i, ref in enumerate(msg.more_layers)]
            for _, *offsets in layers:
                for name, offset in offsets:
                    if offset % dtype.itemsize or offset + size > data.numel():
                        raise PieceRejected(f"{name} {offset} + {size} bytes is not inside {msg.shm_path} "
                                            f"({data.numel()} bytes) at a multiple of {dtype.itemsize}")
            typed, strides = data.view(dtype), (shape[1] * shape[2], shape[2], 1)  # one op a tensor, not three
            return [(layer, *(typed.as_strided(shape, strides, offset // dtype.itemsize) for _, offset in offsets))
                    for layer, *offsets in layers]

        yield tensors


def _map(path: str) -> torch.Tensor:
    """A sender's file, mapped read-only: only a regular file of ours, straight in /dev/shm."""
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        raise PieceRejected(f"shm_path must be a file {SHM_DIR}/{PREFIX}*, got {path!r}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise PieceRejected(f"cannot open {path}: {e.strerror} (is the sender on this host?)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            raise PieceRejected(f"{path} is not a sender's staging file")
        return torch.frombuffer(mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ), dtype=torch.uint8)
    finally:
        os.close(fd)


class Dialer:
    """A prefill rank's pushes to decode ranks' sockets."""

    def __init__(self, rank: int, ranks: int, links) -> None:
        sweep()

    def prepare(self, addresses: tuple[str, ...]) -> int:
        return 0  # nothing to set up ahead of a push

    def senders(self, addresses: tuple[str, ...], link: int, request_id: str, timeout_s: float) -> list[KVSender]:
        return [SharedMemorySender(a, request_id, r, timeout_s=timeout_s) for r, a in enumerate(addresses)]

    def close(self) -> None:
        pass  # a push's connection closes with it


class Endpoint:
    """A decode rank's socket in /dev/shm (`address`: its path), each push served on a thread of its own."""

    def __init__(self, rank: int, ranks: int, receiver: KVReceiver, links, shared_address: str | None) -> None:
        self.service = SharedMemoryService(receiver, rank)
        self._server = local_socket.Server(SHM_DIR, PREFIX, self._push, links.thread_init if links else None)
        self.address = self._server.path

    def _push(self, frames) -> bytes:
        return self.service.Push(frames, None).SerializeToString()

    def stop(self) -> None:
        self._server.close()


shared = grpc_stream.shared  # every decode rank serves on its own
