"""KV transfer over torch.distributed point-to-point in a process group per prefill/decode pair
(gloo on CPU; NCCL on GPUs, which is the NVLink / InfiniBand RDMA path).

Group ranks: the prefill instance's ranks first, then the decode instance's. Each
sender is a stream, numbered uniquely in its process. Every layer is one DATA
message: a descriptor (tag 1: kind, stream, layer, header size, dtype, payload
shape), then the keys and the values of all the layer's pieces (two messages of
tag 3, not waited for: the sink gathers the next layer while they travel). A header
(tag 2: the pieces' destination runs and the request id) follows the descriptor
only when it changes: on a stream's first message and when a layer's runs differ
from the last ones sent, so a request costs one small message per layer, not two
(each small gloo message is a round trip). A final END message asks for the
acknowledgement (tag 4): status and bytes written, then the reason when a piece
was refused.

A sender's messages are atomic on its group: senders of one process share the
group's `lock` (the engine step and a finishing thread may send at once), and
`finish` holds it from END to the acknowledgement. The group may be given as a
callable, called on `open()` (forming a pair group needs every rank: see
`kvtransfer.pairing`).

`TorchP2PReceiver` runs a thread on each decode rank that takes messages from any
source (`recv_anysource` on the descriptor tag, then the rest from that source)
and writes them through a `KVReceiver`: a layer whose destination is one range
of slots is received straight into the cache where the receiver lets it land
(`KVReceiver.landing`: no copy on the decode side), others into a buffer first.
Any-source receive is gloo's; NCCL has none, so CUDA caches would need one
receive loop per source rank (not built).
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections import OrderedDict
from typing import Callable

import torch

from engine.errors import NoReservation
from engine.threads import off_the_engine_thread
from kvtransfer.transport import KVReceiver, KVSender, PieceRejected, TransferError

TAG_DESCRIPTOR, TAG_HEADER, TAG_PAYLOAD, TAG_ACK = 1, 2, 3, 4
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DESCRIPTOR_LEN = 8  # kind, stream, layer, header size, dtype, tokens, heads, head_dim
_stream_ids = itertools.count()  # a sender's stream number, unique in its process


class Kind(enum.IntEnum):
    DATA = 0  # one layer's pieces
    END = 1  # the request's last message: acknowledge it


def _header(request_id: str, runs: list[tuple[int, int]]) -> torch.Tensor:
    """[runs, (first slot, tokens) per run, request id bytes]."""
    return torch.tensor([len(runs), *(x for run in runs for x in run), *request_id.encode()], dtype=torch.long)


def _parse_header(header: torch.Tensor) -> tuple[str, list[tuple[int, int]]]:
    values = header.tolist()
    pairs = values[1:1 + 2 * values[0]]
    return bytes(values[1 + 2 * values[0]:]).decode(), list(zip(pairs[::2], pairs[1::2]))


class TorchP2PSender(KVSender):
    def __init__(self, group, request_id: str, dst_group_rank: int, lock: threading.Lock | None = None) -> None:
        """`group`: a process group, or a callable returning it (called by `open`)."""
        super().__init__()
        self._group, self.request_id, self.dst = group, request_id, dst_group_rank
        self.lock = lock or threading.Lock()
        self.stream = next(_stream_ids)
        self._runs_sent: list[tuple[int, int]] | None = None  # what the receiver holds for this stream
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # (send work, its tensor) of the last payload

    @property
    def group(self):
        if callable(self._group):
            self._group = self._group()
        return self._group

    def _open(self) -> None:
        self._group = self.group  # joins the group now, on every source rank

    def _send_layer(self, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor) -> None:
        with self.lock:  # one message at a time on this group from this process
            self._exchange(Kind.DATA, layer, runs, (keys, values))

    def _exchange(self, kind: Kind, layer: int, runs: list[tuple[int, int]] | None,
                  payload: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Posts a message's sends (`runs` None: whatever the receiver holds). The payload's complete while
        the caller gathers the next layer: they are waited for before the next message and on finish (gloo
        matches a pair's messages of one tag in order)."""
        header = None
        if self._runs_sent is None or (runs is not None and runs != self._runs_sent):
            self._runs_sent = runs or []
            header = _header(self.request_id, self._runs_sent)
        layout = [DTYPE_CODES[payload[0].dtype], *payload[0].shape] if payload else [0, 0, 0, 0]  # dtype, N, H, D
        descriptor = torch.tensor([kind, self.stream, layer, 0 if header is None else header.numel(), *layout],
                                  dtype=torch.long)
        try:
            self._wait_in_flight()
            group = self.group
            group.send([descriptor], self.dst, TAG_DESCRIPTOR).wait()
            if header is not None:
                group.send([header], self.dst, TAG_HEADER).wait()
            for tensor in payload or ():  # keys, then values
                tensor = tensor.contiguous()
                self._in_flight.append((group.send([tensor], self.dst, TAG_PAYLOAD), tensor))
        except RuntimeError as e:
            self._in_flight.clear()
            raise TransferError(f"KV send to group rank {self.dst} failed: {e}") from None

    def _wait_in_flight(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        for work, _tensor in in_flight:  # the tensor stays alive until its send completed
            work.wait()

    def settle(self) -> None:
        with self.lock:
            try:
                self._wait_in_flight()
            except RuntimeError as e:
                self._fail(TransferError(f"KV send to group rank {self.dst} failed: {e}"))

    def _finish(self, timeout_s: float) -> None:
        with self.lock:  # acknowledgements come in END order: nobody else may END in between
            self._end()

    def _end(self) -> None:
        self._exchange(Kind.END, 0, None, None)
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
        self._streams: dict[tuple[int, int], tuple[str, list[tuple[int, int]]]] = {}  # (source, stream) -> header
        self._done = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="kv-p2p-receiver", daemon=True)
        self.thread.start()

    def wait_for(self, keys: list[tuple[int, str]], timeout_s: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: all(k in self.completed for k in keys), timeout=timeout_s)

    def _loop(self) -> None:
        off_the_engine_thread()  # its copies into the cache must not take the engine's intra-op threads
        try:
            while True:
                self._receive_one()
        except RuntimeError:
            if self.on_exit is not None:
                self.on_exit()  # the group was closed or a peer died

    def _receive_payload(self, source: int, request_id: str, layer: int, runs: list[tuple[int, int]],
                         shape: tuple[int, int, int], dtype: torch.dtype) -> None:
        """A layer's keys, then values: straight into the cache where the receiver lets them land, else into a
        buffer written after; a refused piece's are taken off the group and dropped."""
        key = (source, request_id)
        if key not in self._refused:
            try:
                with self.receiver.landing(request_id, layer, runs, shape, dtype) as views:
                    if views is not None:  # both receives posted first: gloo moves a posted one at once
                        for work in [self.group.recv([view], source, TAG_PAYLOAD) for view in views]:
                            work.wait()
                        self._written[key] = self._written.get(key, 0) + 2 * views[0].numel() * views[0].element_size()
                        return
            except (PieceRejected, NoReservation) as e:
                self._refused[key] = str(e)
        keys, values = torch.empty((2, *shape), dtype=dtype)
        for work in [self.group.recv([tensor], source, TAG_PAYLOAD) for tensor in (keys, values)]:
            work.wait()
        if key not in self._refused:
            try:
                self._written[key] = self._written.get(key, 0) + self.receiver.write_runs(
                    request_id, layer, runs, keys, values)
            except (PieceRejected, NoReservation) as e:
                self._refused[key] = str(e)

    def _receive_one(self) -> None:
        descriptor = torch.zeros(DESCRIPTOR_LEN, dtype=torch.long)
        work = self.group.recv_anysource([descriptor], TAG_DESCRIPTOR)
        work.wait()
        source = work._source_rank()
        kind, stream, layer, header_len, dtype, num_tokens, heads, head_dim = descriptor.tolist()
        if header_len:
            header = torch.zeros(header_len, dtype=torch.long)
            self.group.recv([header], source, TAG_HEADER).wait()
            self._streams[(source, stream)] = _parse_header(header)
        request_id, runs = self._streams[(source, stream)] if kind == Kind.DATA else self._streams.pop((source, stream))
        key = (source, request_id)
        if kind == Kind.DATA:
            self._receive_payload(source, request_id, layer, runs, (num_tokens, heads, head_dim), CODE_DTYPES[dtype])
            return
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
