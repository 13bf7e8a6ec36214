"""KV transfer through shared memory, for a prefill and a decode instance on one host: the `grpc_stream`
protocol, whose messages say where each layer's keys and values lie instead of carrying them.

A sender writes the layers of its push, one after the other, into a file of its own in /dev/shm (one
copy, no serialisation); each `KVPiece` names the file and the offset. The decode rank opens the file at
the first piece and unlinks it at once, so the memory goes back when both ends close it, whatever
happens to either afterwards; it reads each layer from there into a buffer and writes it through the
same checks as every transport (`KVReceiver`). A file's name carries its sender's pid: a prefill rank
killed before decode opened its file leaves it behind, and the next sender on the host removes it
(`sweep`). A path that is not one of ours in /dev/shm is refused, and a decode rank on another host
cannot open the file: the push fails and decode recomputes the prompt, so pick this transport for
prefill and decode instances that share a host.

The transport entry `shared_memory` (`kvtransfer.transports`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch

from kvtransfer import grpc_stream
from kvtransfer.transport import PieceRejected
from protos.infermesh.v1 import internal_pb2

SHM_DIR = "/dev/shm"
PREFIX = "infermesh-kv-"


class SharedMemorySender(grpc_stream.GrpcStreamSender):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.path = ""
        self._file = None

    def _piece(self, piece: internal_pb2.KVPiece, keys: torch.Tensor, values: torch.Tensor) -> bytes:
        if self._file is None:
            fd, self.path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=SHM_DIR)
            self._file = os.fdopen(fd, "wb", buffering=0)
        piece.shm_path, piece.shm_offset = self.path, self._file.tell()
        for tensor in (keys, values):
            self._file.write(grpc_stream.tensor_buffer(tensor))
        return piece.SerializeToString()

    def finish(self, timeout_s: float = 60.0):
        try:
            return super().finish(timeout_s)
        finally:  # done or failed: the file goes (decode has unlinked it already when it opened it)
            if self._file is not None:
                self._file.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)


class SharedMemoryService(grpc_stream.KVTransferService):
    @contextlib.contextmanager
    def reader(self):
        files: dict[str, int] = {}  # path -> descriptor, for this stream
        buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)]  # this stream's, reused layer by layer

        def tensors(msg, dtype, shape, size):
            fd = files.get(msg.shm_path)
            if fd is None:
                fd = files[msg.shm_path] = _open_once(msg.shm_path)
            if buffers[0].numel() < 2 * size:
                buffers[0] = torch.empty(2 * size, dtype=torch.uint8)
            buffer = buffers[0][:2 * size]  # written into the cache before the next message is read
            read = os.preadv(fd, [buffer.numpy()], msg.shm_offset)
            if read != 2 * size:
                raise PieceRejected(f"{msg.shm_path} holds {read} bytes at {msg.shm_offset}, the piece needs "
                                    f"{2 * size}")
            return buffer.view(dtype).view(2, *shape)  # keys, values

        try:
            yield tensors
        finally:
            for fd in files.values():
                os.close(fd)


def _open_once(path: str) -> int:
    """Open a sender's file and unlink it: only a regular file of ours, straight in /dev/shm."""
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        raise PieceRejected(f"shm_path must be a file {SHM_DIR}/{PREFIX}*, got {path!r}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise PieceRejected(f"cannot open {path}: {e.strerror} (is the sender on this host?)") from None
    os.unlink(path)
    return fd


def sweep() -> list[str]:
    """Remove the files of senders that are gone (killed before decode opened their file); what was removed."""
    removed = []
    for name in os.listdir(SHM_DIR):
        pid = name.removeprefix(PREFIX).split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Dialer(grpc_stream.Dialer):
    sender = SharedMemorySender

    def __init__(self, rank: int, ranks: int, links) -> None:
        super().__init__(rank, ranks, links)
        sweep()


class Endpoint(grpc_stream.Endpoint):
    service = SharedMemoryService


shared = grpc_stream.shared
