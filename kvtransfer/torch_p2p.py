"""KV transfer over torch.distributed point-to-point in a process group per prefill/decode pair
(gloo on CPU; NCCL on GPUs, which is the NVLink / InfiniBand RDMA path).

Group ranks: the prefill instance's ranks first, then the decode instance's. Per
(request, source rank, destination rank), every layer is one DATA message: a
descriptor (tag 1: kind, sizes, dtype), a header with the layer, the pieces'
destination slots and the request id (tag 2), and one payload holding keys and
values of all the layer's pieces (tag 3). A final END message (descriptor, then a
header holding only the request id's length and bytes) asks for the acknowledgement (tag 4): status
and bytes written, then the reason when a piece was refused.

A sender's messages are atomic on its group: senders of one process share the
group's `lock` (the engine step and a finishing thread may send at once), and
`finish` holds it from END to the acknowledgement. The group may be given as a
callable, called on `open()` (forming a pair group needs every rank: see
`kvtransfer.pairing`).

`TorchP2PReceiver` runs a thread on each decode rank that takes messages from any
source (`recv_anysource` on the descriptor tag, then the rest from that source)
and writes them through a `KVReceiver`. That is gloo's; NCCL has no any-source
receive, so CUDA caches would need one receive loop per source rank (not built).
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from typing import Callable

import torch

from engine.errors import NoReservation
from kvtransfer.transport import KVReceiver, KVSender, PieceRejected, TransferError

TAG_DESCRIPTOR, TAG_HEADER, TAG_PAYLOAD, TAG_ACK = 1, 2, 3, 4
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class Kind(enum.IntEnum):
    DATA = 0  # one layer's pieces
    END = 1  # the request's last message: acknowledge it


def _data_header(request_id: str, layer: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    """[layer, runs, (first slot, tokens) per run, request id bytes]."""
    return torch.tensor([layer, len(runs), *(x for run in runs for x in run), *request_id.encode()], dtype=torch.long)


def _parse_data_header(header: torch.Tensor) -> tuple[str, int, list[tuple[int, int]]]:
    values = header.tolist()
    layer, count = values[:2]
    pairs = values[2:2 + 2 * count]
    return bytes(values[2 + 2 * count:]).decode(), layer, list(zip(pairs[::2], pairs[1::2]))


def _end_header(request_id: str) -> torch.Tensor:
    """[request id length, request id bytes] (never empty)."""
    name = request_id.encode()
    return torch.tensor([len(name), *name], dtype=torch.long)


class TorchP2PSender(KVSender):
    def __init__(self, group, request_id: str, dst_group_rank: int, lock: threading.Lock | None = None) -> None:
        """`group`: a process group, or a callable returning it (called by `open`)."""
        super().__init__()
        self._group, self.request_id, self.dst = group, request_id, dst_group_rank
        self.lock = lock or threading.Lock()

    @property
    def group(self):
        if callable(self._group):
            self._group = self._group()
        return self._group

    def _open(self) -> None:
        self._group = self.group  # joins the group now, on every source rank

    def _send_layer(self, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor) -> None:
        with self.lock:  # one message at a time on this group from this process
            self._exchange(Kind.DATA, _data_header(self.request_id, layer, runs),
                           torch.stack([keys, values]))  # [2, N, H, D]

    def _exchange(self, kind: Kind, header: torch.Tensor, payload: torch.Tensor | None) -> None:
        heads, head_dim = (payload.shape[2], payload.shape[3]) if payload is not None else (0, 0)
        dtype = DTYPE_CODES[payload.dtype] if payload is not None else 0
        descriptor = torch.tensor([kind, header.numel(), 0 if payload is None else payload.shape[1], dtype, heads,
                                   head_dim], dtype=torch.long)
        try:
            group = self.group
            group.send([descriptor], self.dst, TAG_DESCRIPTOR).wait()
            group.send([header], self.dst, TAG_HEADER).wait()
            if payload is not None:
                group.send([payload.contiguous()], self.dst, TAG_PAYLOAD).wait()
        except RuntimeError as e:
            raise TransferError(f"KV send to group rank {self.dst} failed: {e}") from None

    def _finish(self, timeout_s: float) -> None:
        with self.lock:  # acknowledgements come in END order: nobody else may END in between
            self._end()

    def _end(self) -> None:
        self._exchange(Kind.END, _end_header(self.request_id), None)
        ack = torch.zeros(3, dtype=torch.long)  # status, bytes, reason length
        try:
            self.group.recv([ack], self.dst, TAG_ACK).wait()
            status, _, reason_len = ack.tolist()
            if status != 0:
                reason = torch.zeros(reason_len, dtype=torch.uint8)
                self.group.recv([reason], self.dst, TAG_ACK).wait()
                raise TransferError(f"group rank {self.dst} refused KV of {self.request_id!r}: "
                                    f"{bytes(reason.tolist()).decode()}")
        except RuntimeError as e:
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"no acknowledgement from group rank {self.dst}: {e}") from None


class TorchP2PReceiver:
    """A daemon thread writing the pieces that arrive on `group` into `receiver`; stops when the group fails."""

    KEEP_COMPLETED = 1024

    def __init__(self, group, receiver: KVReceiver, on_exit: Callable[[], None] | None = None) -> None:
        self.group, self.receiver, self.on_exit = group, receiver, on_exit
        # (source group rank, request id) -> bytes, once acknowledged; the latest KEEP_COMPLETED
        self.completed: OrderedDict[tuple[int, str], int] = OrderedDict()
        self._written: dict[tuple[int, str], int] = {}
        self._refused: dict[tuple[int, str], str] = {}
        self._done = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="kv-p2p-receiver", daemon=True)
        self.thread.start()

    def wait_for(self, keys: list[tuple[int, str]], timeout_s: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: all(k in self.completed for k in keys), timeout=timeout_s)

    def _loop(self) -> None:
        try:
            while True:
                self._receive_one()
        except RuntimeError:
            if self.on_exit is not None:
                self.on_exit()  # the group was closed or a peer died

    def _receive_one(self) -> None:
        descriptor = torch.zeros(6, dtype=torch.long)
        work = self.group.recv_anysource([descriptor], TAG_DESCRIPTOR)
        work.wait()
        source = work._source_rank()
        kind, header_len, num_tokens, dtype, heads, head_dim = descriptor.tolist()
        header = torch.zeros(header_len, dtype=torch.long)
        self.group.recv([header], source, TAG_HEADER).wait()
        if kind == Kind.DATA:
            request_id, layer, slots = _parse_data_header(header)
            key = (source, request_id)
            payload = torch.zeros((2, num_tokens, heads, head_dim), dtype=CODE_DTYPES[dtype])
            self.group.recv([payload], source, TAG_PAYLOAD).wait()
            if key not in self._refused:
                try:
                    self._written[key] = self._written.get(key, 0) + self.receiver.write_runs(
                        request_id, layer, slots, payload[0], payload[1])
                except (PieceRejected, NoReservation) as e:
                    self._refused[key] = str(e)
            return
        key = (source, bytes(header.tolist()[1:]).decode())
        reason = self._refused.pop(key, "").encode()
        written = self._written.pop(key, 0)
        self.group.send([torch.tensor([1 if reason else 0, written, len(reason)])], source, TAG_ACK).wait()
        if reason:
            self.group.send([torch.tensor(list(reason), dtype=torch.uint8)], source, TAG_ACK).wait()
        else:
            with self._done:
                self.completed[key] = written
                while len(self.completed) > self.KEEP_COMPLETED:
                    self.completed.popitem(last=False)
                self._done.notify_all()
