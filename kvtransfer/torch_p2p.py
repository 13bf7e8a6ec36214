"""KV transfer over torch.distributed point-to-point in a process group per prefill/decode pair
(gloo on CPU; NCCL on GPUs, which is the NVLink / InfiniBand RDMA path).

Group ranks: the prefill instance's ranks first, then the decode instance's. Each
sender is a stream, numbered uniquely in its process, whose payloads travel on a
tag of their own. A DATA message announces a run of layers: a descriptor (tag 1:
kind, stream, first layer, header size, dtype, payload shape, last layer) that
says every layer from the first through the last follows with these runs and
shape (a `PlanSink` push announces all its layers at its first: `KVSender.open`);
then each layer is only its payload, the keys and the values of all its pieces
(two messages on the stream's tag, not waited for: the sink gathers the next
layer while they travel). The receiver posts the receives of every announced
layer at once, so no layer waits for a receive to be posted (a gloo message
whose receive is not posted yet stalls its pair until it is). A header (tag 2:
the pieces' destination runs and the request id) follows the descriptor only
when it changes. A final END message asks for the acknowledgement (tag 4):
status and bytes written, then the reason when a piece was refused. A layer that
breaks an announced run (not the next layer, other runs or shape) first sends
the rest of the run as zeros and the push is refused at END: the receiver is
never left with a receive posted.

A sender's messages are atomic on its group: senders of one process share the
group's `lock` (the engine step and a finishing thread may send at once), and
`finish` holds it from END to the acknowledgement. The group may be given as a
callable, called on `open()` (forming a pair group needs every rank: see
`kvtransfer.pairing`).

`TorchP2PReceiver` runs a thread per source rank on each decode rank that takes
that source's descriptors and posts each announced layer's receives: straight
into the cache where the receiver lets it land (`KVReceiver.landing`: no copy on
the decode side), others into a buffer written at END. At END every payload of
the stream has arrived (a pair's messages arrive in order). A receive from one
source fails as soon as that peer dies, so its landings close and their blocks
may go; gloo's any-source receive is not woken by a dead peer (it would wait out
the group's timeout, a year on the decode side), and NCCL has none. So a
receiving process should not be shutting down its interpreter just as a source
leaves: a receive thread woken then aborts the process (a C++ wait returning
into a finalizing Python 3.11). A decode instance stops while its prefill peers
serve on, and nothing wakes.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from engine.errors import NoReservation
from engine.parallel.groups import IDLE
from engine.threads import off_the_engine_thread
from kvtransfer.transport import KVReceiver, KVSender, PieceRejected, TransferError

TAG_DESCRIPTOR, TAG_HEADER, TAG_ACK, TAG_PARTING = 1, 2, 4, 8
TAG_STREAMS, STREAM_TAGS = 1 << 8, 1 << 30  # stream s's payloads: tag TAG_STREAMS + s % STREAM_TAGS
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DESCRIPTOR_LEN = 9  # kind, stream, layer, header size, dtype, tokens, heads, head_dim, last layer (or cut short)
_stream_ids = itertools.count()  # a sender's stream number, unique in its process


class Kind(enum.IntEnum):
    DATA = 0  # a run of layers, announced
    END = 1  # the request's last message: acknowledge it


def payload_tag(stream: int) -> int:
    return TAG_STREAMS + stream % STREAM_TAGS


def _header(request_id: str, runs: list[tuple[int, int]]) -> torch.Tensor:
    """[runs, (first slot, tokens) per run, request id bytes]."""
    return torch.tensor([len(runs), *(x for run in runs for x in run), *request_id.encode()], dtype=torch.long)


def _parse_header(header: torch.Tensor) -> tuple[str, list[tuple[int, int]]]:
    values = header.tolist()
    pairs = values[1:1 + 2 * values[0]]
    return bytes(values[1 + 2 * values[0]:]).decode(), list(zip(pairs[::2], pairs[1::2]))


@dataclass(slots=True)
class _Announced:
    """What the receiver expects next on a stream: layers `next`..`last`, each with these runs and payload."""

    next: int
    last: int
    runs: list[tuple[int, int]]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def takes(self, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor) -> bool:
        return (layer, runs, tuple(keys.shape), keys.dtype) == (self.next, self.runs, self.shape, self.dtype)


def part_pair(group, sources: int) -> None:
    """For a pair's processes that end together (tests, benchmarks): the receiving ranks (those past the first
    `sources`) leave first, and at once — `os._exit(0)`, without finalizing their interpreter: finalizing closes
    the group, which wakes a receive thread's posted receive into a finalizing Python (the module's docstring;
    a benchmark's receiving rank aborted so once). A source returns once every receiving rank has closed its
    connection. What a receiving rank reports must be written before (a `SimpleQueue` writes at `put`)."""
    group.barrier().wait()
    if group.rank() >= sources:
        os._exit(0)
    for peer in range(sources, group.size()):
        with contextlib.suppress(RuntimeError):  # the peer closed the pair: it has left
            group.recv([torch.zeros(1)], peer, TAG_PARTING).wait()


class TorchP2PSender(KVSender):
    def __init__(self, group, request_id: str, dst_group_rank: int, lock: threading.Lock | None = None) -> None:
        """`group`: a process group, or a callable returning it (called by `open`)."""
        super().__init__()
        self._group, self.request_id, self.dst = group, request_id, dst_group_rank
        self.lock = lock or threading.Lock()
        self.stream = next(_stream_ids)
        self.tag = payload_tag(self.stream)
        self._runs_sent: list[tuple[int, int]] | None = None  # what the receiver holds for this stream
        self._announced: _Announced | None = None
        self._cut_short = False  # an announced run was filled with zeros: the receiver refuses the push
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # (send work, its tensor), until settled

    @property
    def group(self):
        if callable(self._group):
            self._group = self._group()
        return self._group

    def _open(self) -> None:
        self._group = self.group  # joins the group now, on every source rank

    def _send_layer(self, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor) -> None:
        with self.lock:  # one message at a time on this group from this process
            try:
                announced = self._announced
                if announced is None or not announced.takes(layer, runs, keys):
                    self._fill_announced()
                    last = layer if self.last_layer is None or self.last_layer < layer else self.last_layer
                    self._descriptor(Kind.DATA, layer, runs, keys, last)
                    announced = self._announced = _Announced(layer, last, runs, tuple(keys.shape), keys.dtype)
                self._post(keys, values)
                announced.next += 1
                if announced.next > announced.last:
                    self._announced = None
            except RuntimeError as e:
                self._in_flight.clear()
                raise TransferError(f"KV send to group rank {self.dst} failed: {e}") from None

    def _descriptor(self, kind: Kind, layer: int, runs: list[tuple[int, int]] | None, keys: torch.Tensor | None,
                    last: int) -> None:
        """A descriptor, and the header after it when the runs changed (`runs` None: whatever the receiver holds)."""
        header = None
        if self._runs_sent is None or (runs is not None and runs != self._runs_sent):
            self._runs_sent = runs or []
            header = _header(self.request_id, self._runs_sent)
        layout = [DTYPE_CODES[keys.dtype], *keys.shape] if keys is not None else [0, 0, 0, 0]  # dtype, N, H, D
        descriptor = torch.tensor([kind, self.stream, layer, 0 if header is None else header.numel(), *layout, last],
                                  dtype=torch.long)
        self.group.send([descriptor], self.dst, TAG_DESCRIPTOR).wait()
        if header is not None:
            self.group.send([header], self.dst, TAG_HEADER).wait()

    def _post(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A layer's payload, not waited for: the tensors stay alive until `settle`."""
        for tensor in (keys, values):
            tensor = tensor.contiguous()
            self._in_flight.append((self.group.send([tensor], self.dst, self.tag), tensor))

    def _fill_announced(self) -> None:
        """Zeros for the layers still announced (the receiver has their receives posted); the push is then refused."""
        announced, self._announced = self._announced, None
        if announced is None:
            return
        zeros = torch.zeros(announced.shape, dtype=announced.dtype)
        for _ in range(announced.next, announced.last + 1):
            self._post(zeros, zeros)
        self._cut_short = True

    def _wait_in_flight(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        for work, _tensor in in_flight:  # the tensor stays alive until its send completed
            work.wait()

    def settle(self) -> None:
        with self.lock:
            try:
                self._wait_in_flight()
            except RuntimeError as e:
                self._in_flight.clear()
                self._fail(TransferError(f"KV send to group rank {self.dst} failed: {e}"))

    def _finish(self, timeout_s: float) -> None:
        with self.lock:  # acknowledgements come in END order: nobody else may END in between
            self._end()

    def _end(self) -> None:
        ack = torch.zeros(3, dtype=torch.long)  # status, bytes, reason length
        try:
            self._fill_announced()
            self._wait_in_flight()
            self._descriptor(Kind.END, 0, None, None, int(self._cut_short))
            self.group.recv([ack], self.dst, TAG_ACK).wait()
            status, _, reason_len = ack.tolist()
            if status != 0:
                reason = torch.zeros(reason_len, dtype=torch.uint8)
                self.group.recv([reason], self.dst, TAG_ACK).wait()
        except RuntimeError as e:
            self._in_flight.clear()
            raise TransferError(f"KV send to group rank {self.dst} failed or was not acknowledged: {e}") from None
        if status != 0:
            raise TransferError(f"group rank {self.dst} refused KV of {self.request_id!r}: "
                                f"{bytes(reason.tolist()).decode()}")


@dataclass(slots=True)
class _Stream:
    """What a receiver holds for one stream: its header, the receives it posted, the landings they fill."""

    request_id: str
    runs: list[tuple[int, int]]
    # (layer, its runs, its receives' works, the buffer they fill or None)
    receives: list[tuple[int, list[tuple[int, int]], list, torch.Tensor | None]] = field(default_factory=list)
    landings: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class TorchP2PReceiver:
    """Daemon threads, one per source rank, writing the pieces that arrive on `group` into `receiver`; each stops
    when its source fails, and the first to stop calls `on_exit` (the group is then broken)."""

    KEEP_COMPLETED = 1024

    def __init__(self, group, receiver: KVReceiver, sources: Iterable[int],
                 on_exit: Callable[[], None] | None = None) -> None:
        """`sources`: the group ranks that send here (the prefill instance's)."""
        self.group, self.receiver, self.on_exit = group, receiver, on_exit
        # (source group rank, request id) -> bytes, once acknowledged; the latest KEEP_COMPLETED
        self.completed: OrderedDict[tuple[int, str], int] = OrderedDict()
        self._written: dict[tuple[int, str], int] = {}  # keyed by source: each thread touches its own keys
        self._refused: dict[tuple[int, str], str] = {}
        self._streams: dict[tuple[int, int], _Stream] = {}  # (source, stream) -> what it holds
        self._done = threading.Condition()
        self._exited = False
        self.threads = [threading.Thread(target=self._loop, args=(source,), name=f"kv-p2p-receiver-{source}",
                                         daemon=True) for source in sources]
        for thread in self.threads:
            thread.start()

    def wait_for(self, keys: list[tuple[int, str]], timeout_s: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: all(k in self.completed for k in keys), timeout=timeout_s)

    def _loop(self, source: int) -> None:
        off_the_engine_thread()  # its copies into the cache must not take the engine's intra-op threads
        try:
            while True:
                self._receive_one(source)
        except RuntimeError:
            for key in [key for key in list(self._streams) if key[0] == source]:  # list(): other threads add
                self._streams.pop(key).landings.close()  # the source is gone: nothing of it lands any more
            with self._done:
                first, self._exited = not self._exited, True
            if first and self.on_exit is not None:
                self.on_exit()  # the group was closed or a peer died

    def _receive_one(self, source: int) -> None:
        descriptor = torch.zeros(DESCRIPTOR_LEN, dtype=torch.long)
        self.group.recv([descriptor], source, TAG_DESCRIPTOR).wait(IDLE)  # gloo's own timeout would break the pair
        kind, stream_id, layer, header_len, dtype, num_tokens, heads, head_dim, last = descriptor.tolist()
        stream = self._streams.get((source, stream_id))
        if header_len:
            header = torch.zeros(header_len, dtype=torch.long)
            self.group.recv([header], source, TAG_HEADER).wait()
            request_id, runs = _parse_header(header)
            stream = self._streams.setdefault((source, stream_id), _Stream(request_id, runs))
            stream.runs = runs
        if kind == Kind.DATA:
            self._post_layers(source, stream_id, stream, range(layer, last + 1), (num_tokens, heads, head_dim),
                              CODE_DTYPES[dtype])
        else:
            self._end(source, self._streams.pop((source, stream_id)), cut_short=bool(last))

    def _post_layers(self, source: int, stream_id: int, stream: _Stream, layers: range, shape: tuple[int, int, int],
                     dtype: torch.dtype) -> None:
        """Every announced layer's keys and values receives, posted now: straight into the cache where the
        receiver lets them land, else into a buffer written at END; a refused piece's into one buffer, dropped."""
        key, tag = (source, stream.request_id), payload_tag(stream_id)
        landed = None  # per layer, its keys' and values' slots in the cache
        if key not in self._refused:
            try:
                landed = stream.landings.enter_context(
                    self.receiver.landing(stream.request_id, layers, stream.runs, shape, dtype))
            except (PieceRejected, NoReservation) as e:
                self._refused[key] = str(e)
        if landed is not None:
            self._written[key] = self._written.get(key, 0) + len(layers) * 2 * math.prod(shape) * dtype.itemsize
        dropped = None  # one buffer for every refused layer: what arrives there is never read
        for i, layer in enumerate(layers):
            views = buffer = None
            if landed is not None:
                views = landed[i]
            elif key in self._refused:
                dropped = views = dropped if dropped is not None else torch.empty((2, *shape), dtype=dtype)
            else:
                views = buffer = torch.empty((2, *shape), dtype=dtype)
            stream.receives.append((layer, stream.runs, [self.group.recv([view], source, tag) for view in views],
                                    buffer))

    def _end(self, source: int, stream: _Stream, cut_short: bool) -> None:
        """Every payload of the stream has arrived: write the buffered layers, close the landings, acknowledge."""
        key = (source, stream.request_id)
        try:
            for layer, runs, works, buffer in stream.receives:
                for work in works:
                    work.wait()
                if buffer is not None and key not in self._refused:
                    try:
                        self._written[key] = self._written.get(key, 0) + self.receiver.write_runs(
                            stream.request_id, layer, runs, buffer[0], buffer[1])
                    except (PieceRejected, NoReservation) as e:
                        self._refused[key] = str(e)
        finally:
            stream.landings.close()
        if cut_short:
            self._refused.setdefault(key, "the sender cut an announced run of layers short")
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
