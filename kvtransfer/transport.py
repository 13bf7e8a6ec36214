"""The transport contract: one request's KV pieces to one destination rank, with explicit states.

    PENDING --send()--> TRANSFERRING --finish()--> DONE
                             \\--(error, timeout, abort)--> FAILED

A sender is used from one thread: `send` pieces in layer order (a transport gets
each layer's pieces as one batch), then `finish`, which returns only once the
receiver has acknowledged every piece (or raises `TransferError` and leaves the
sender FAILED). The receiving side is a
`KVReceiver` writing pieces into a rank's cache after checking each one lands in
blocks reserved for that request. `LoopbackSender` calls a receiver in process
(tests, warm-up); gRPC streams and torch.distributed point-to-point are the real ones.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch

from engine.errors import NoReservation, RequestError
from kvtransfer.plan import Piece
from kvtransfer.transports import KVOptions


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class TransferError(RuntimeError):
    """A transfer failed; decode falls back to recomputing the prompt."""


class PieceRejected(RequestError):
    """A piece the receiver refuses: out of its request's blocks, wrong layer, shape or dtype (a request
    without a reservation here is `NoReservation`)."""


@dataclass(frozen=True, slots=True)
class TransferStats:
    bytes: int
    pieces: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class KVReceiver:
    """Writes pieces into one rank's KV cache; `reserved(request_id)` gives the request's block table or None.

    The caller keeps a reservation's blocks allocated until every push to it has ended. A caller that gives
    `on_landed` also lets transports receive straight into the cache (`landing`); it then holds a
    reservation's blocks back from reuse when the reservation ends while `landings(request_id)` is not 0,
    until `on_landed(request_id)` says the last landing into them closed (a receive can outlast a cancel)."""

    def __init__(self, kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
                 reserved: Callable[[str], tuple[int, ...] | None], lock: threading.Lock | None = None,
                 on_landed: Callable[[str], None] | None = None) -> None:
        self.kv_cache, self.reserved, self.on_landed = kv_cache, reserved, on_landed
        _, self.block_size, self.num_heads, self.head_dim = kv_cache[0][0].shape
        self.dtype = kv_cache[0][0].dtype
        self.lock = lock or threading.Lock()  # the owner frees reservations under the same lock
        self._landings: Counter[str] = Counter()  # request id -> landings open into its blocks (under lock)
        self._landed = threading.Condition(self.lock)  # notified when a request's last landing closed

    def write(self, request_id: str, layer: int, dst_slot: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Store `keys`/`values` [n, heads, head_dim] at slots dst_slot.. of `layer`; returns the bytes written."""
        return self.write_runs(request_id, layer, [(dst_slot, keys.shape[0])], keys, values)

    def write_runs(self, request_id: str, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor,
                   values: torch.Tensor) -> int:
        """Store a layer's pieces at once: `runs` of (first slot, tokens), `keys`/`values` [sum(tokens), heads,
        head_dim] in run order; all of them or, when one is refused, none. Returns the bytes written."""
        self._check_layout(layer, runs, keys=(keys.shape, keys.dtype), values=(values.shape, values.dtype))
        k_cache, v_cache = self.kv_cache[layer]
        with self.lock:  # checked and written atomically: a reservation cannot be freed in between
            self._check_reserved(request_id, runs)
            scatter_rows(k_cache.view(-1, self.num_heads, self.head_dim), runs, keys)
            scatter_rows(v_cache.view(-1, self.num_heads, self.head_dim), runs, values)
        return 2 * keys.numel() * keys.element_size()

    @contextlib.contextmanager
    def landing(self, request_id: str, layers: range, runs: list[tuple[int, int]], shape: tuple[int, ...],
                dtype: torch.dtype) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """Where a transport may receive the keys and values [shape] of each of `layers` straight into the
        cache: per layer, views of the cache's slots when this receiver allows it (`on_landed`) and `runs` are
        one range, else None (receive elsewhere, then `write_runs`). The pieces are checked first, as
        `write_runs` checks them, once for every layer. A receive that fails leaves the range half written:
        the transfer fails, and decode recomputes."""
        ranges = merge_runs(runs)
        if self.on_landed is None or len(ranges) != 1 or not layers:
            self._check_layers(layers, runs, shape, dtype)
            yield None
            return
        (slot, n), = ranges
        with self.holding(request_id, layers, runs, shape, dtype):
            yield [tuple(cache.view(-1, self.num_heads, self.head_dim)[slot:slot + n]  # [n, heads, head_dim]
                         for cache in self.kv_cache[layer]) for layer in layers]

    @contextlib.contextmanager
    def holding(self, request_id: str, layers: range, runs: list[tuple[int, int]], shape: tuple[int, ...],
                dtype: torch.dtype) -> Iterator[None]:
        """Keep the request's blocks from reuse while a transport writes `runs` of `layers` into them itself
        (pieces [shape] of `dtype`, checked first as `write_runs` checks them). When the reservation ends
        meanwhile, `on_landed` says so once the last hold closed; a receiver without it is waited for with
        `wait_landed` before its blocks are reused."""
        self._check_layers(layers, runs, shape, dtype)
        with self.lock:
            self._check_reserved(request_id, runs)
            self._landings[request_id] += 1
        try:
            yield
        finally:
            with self.lock:
                self._landings[request_id] -= 1
                ended = not self._landings[request_id] and self.reserved(request_id) is None
                if not self._landings[request_id]:
                    del self._landings[request_id]
                    self._landed.notify_all()
            if ended and self.on_landed is not None:
                self.on_landed(request_id)

    def wait_landed(self, request_ids, timeout_s: float) -> bool:
        """Under `lock`: wait (releasing it) until no hold into the blocks of `request_ids` is open, at most
        `timeout_s`; whether none is."""
        return self._landed.wait_for(lambda: not any(self._landings[r] for r in request_ids if r in self._landings),
                                     timeout_s)

    def landings(self, request_id: str) -> int:
        """Landings open into the request's blocks; read under `lock`."""
        return self._landings[request_id]

    def _check_layers(self, layers: range, runs: list[tuple[int, int]], shape: tuple[int, ...],
                      dtype: torch.dtype) -> None:
        """Pieces [shape] of `dtype` for every layer of `layers` (a range: its ends bound every layer)."""
        for layer in (layers[0], layers[-1]) if layers else ():
            self._check_layout(layer, runs, pieces=(shape, dtype))

    def _check_layout(self, layer: int, runs: list[tuple[int, int]], **layouts: tuple[tuple[int, ...], torch.dtype]
                      ) -> None:
        """`layouts`: name -> (shape, dtype) of a piece; each must be [sum(tokens), heads, head_dim] of the cache's
        dtype."""
        if not 0 <= layer < len(self.kv_cache):
            raise PieceRejected(f"layer {layer} is out of range [0, {len(self.kv_cache)})")
        expected = (sum(n for _, n in runs), self.num_heads, self.head_dim)
        if any((tuple(shape), dtype) != (expected, self.dtype) for shape, dtype in layouts.values()):
            got = " and ".join(f"{name} {list(shape)} {dtype}" for name, (shape, dtype) in layouts.items())
            raise PieceRejected(f"pieces must be {list(expected)} {self.dtype}, got {got}")

    def _check_reserved(self, request_id: str, runs: list[tuple[int, int]]) -> None:
        """Under `lock`: every run lies in blocks reserved for the request."""
        table = self.reserved(request_id)
        if table is None:
            raise NoReservation(f"request {request_id!r} has no KV reservation here")
        blocks = set(table)
        for slot, n in runs:
            first, last = slot // self.block_size, (slot + n - 1) // self.block_size
            if n < 1 or slot < 0 or last - first >= len(blocks) or not blocks.issuperset(range(first, last + 1)):
                raise PieceRejected(f"slots [{slot}, {slot + n}) are not inside blocks reserved for {request_id!r}")


CPU = torch.device("cpu")
SLICE_COPIES = 16  # up to this many contiguous destination ranges, a copy each beats one indexed copy


def scatter_rows(dst: torch.Tensor, runs: list[tuple[int, int]], rows: torch.Tensor) -> None:
    """dst[slot:slot + n] = the next n of `rows`, for each (slot, n) of `runs` in order (`gather_rows`
    undone). Runs that continue one another (a fresh reservation's blocks usually do) are copied as one
    range at memcpy speed; past SLICE_COPIES ranges, one `index_copy_` moves them all. `rows` may lie on
    another device."""
    ranges = merge_runs(runs)
    if len(ranges) > SLICE_COPIES:
        as_words(dst).index_copy_(0, run_rows(runs).to(dst.device), as_words(rows.to(dst.device).contiguous()))
        return
    first = 0
    for slot, n in ranges:
        dst[slot:slot + n].copy_(rows[first:first + n])
        first += n


def gather_rows(src: torch.Tensor, runs: list[tuple[int, int]], out: torch.Tensor | None = None) -> torch.Tensor:
    """src[slot:slot + n] for each (slot, n) of `runs`, in order, as one contiguous tensor, written into `out`
    when given (it may lie on another device): slice copies for up to SLICE_COPIES merged ranges, past them
    one `index_select`."""
    ranges = merge_runs(runs)
    if out is None:
        out = src.new_empty((sum(n for _, n in ranges), *src.shape[1:]))
    if len(ranges) > SLICE_COPIES:
        rows = run_rows(ranges).to(src.device)
        if out.device != src.device:
            return out.copy_(src.index_select(0, rows))
        return torch.index_select(src, 0, rows, out=out)
    first = 0
    for slot, n in ranges:
        out[first:first + n].copy_(src[slot:slot + n])
        first += n
    return out


def merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`runs` of (first slot, tokens) with each run that starts where the one before ends merged into it."""
    merged: list[tuple[int, int]] = []
    for slot, n in runs:
        if merged and merged[-1][0] + merged[-1][1] == slot:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((slot, n))
    return merged


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """A view of rows [N, ...] (contiguous rows: else `view` raises) as [N, row bytes / 8] int64 when a row is
    whole 8-byte words, else [N, elements]: the same bytes, moved by `index_copy_` ~1.6x faster on CPU than as
    bf16 elements."""
    flat = rows.view(rows.shape[0], -1)
    if (flat.shape[1] * flat.element_size()) % 8 or (flat.storage_offset() * flat.element_size()) % 8:
        return flat
    return flat.view(torch.int64)


def run_rows(runs: list[tuple[int, int]]) -> torch.Tensor:
    """[sum(tokens)] int64: first_slot, first_slot + 1, ... of each run, in order."""
    starts = torch.tensor([slot for slot, _ in runs], dtype=torch.long)
    counts = torch.tensor([n for _, n in runs], dtype=torch.long)
    run_offsets = torch.cumsum(counts, 0) - counts  # row where each run begins
    total = int(counts.sum())
    return torch.repeat_interleave(starts - run_offsets, counts, output_size=total) + torch.arange(total)


class KVSender(abc.ABC):
    """Collects one layer's pieces and hands them to the transport as one batch (`_send_layer`) when the
    layer changes, on `flush()` (the sink calls it after each layer) and on `finish()`."""

    def __init__(self) -> None:
        self.state = TransferState.PENDING
        self._bytes = self._pieces = 0
        self._started = 0.0
        self._error: TransferError | None = None
        self._layer: int | None = None
        self.last_layer: int | None = None  # see open()
        self._pending: list[tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]] = []  # (runs, keys, values)

    def open(self, last_layer: int | None = None) -> None:
        """Called by the sink on every source rank before its first layer, whether the rank has pieces or not
        (a transport that forms a group needs every rank there). `last_layer`: the push sends every layer from
        its first through this one, each with the same runs (a transport may tell the receiver up front). A
        failure leaves the sender FAILED."""
        self.last_layer = last_layer
        try:
            self._open()
        except Exception as e:
            self._fail(e)

    def _open(self) -> None:  # noqa: B027 - most transports need nothing before the first layer
        pass

    def _fail(self, error: Exception) -> TransferError:
        self.state = TransferState.FAILED
        self._error = error if isinstance(error, TransferError) else TransferError(f"sending KV failed: {error!r}")
        return self._error

    def layer_buffers(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device = CPU
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where the sink should gather the next layer's keys and values [shape] (of a cache on `device`: a
        transport that sends from memory of its own), or None: anywhere."""
        return None

    def settle(self) -> None:  # noqa: B027 - a transport that copies what it sends has nothing to wait for
        """Return once no send still reads the tensors it was given (the sink calls it after a step's last layer:
        they may be views of the cache, reused after the step). A failure leaves the sender FAILED."""

    def send(self, layer: int, piece: Piece, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.send_runs(layer, [(piece.dst_slot, piece.num_tokens)], keys, values)

    def send_runs(self, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Pieces of `layer` at once: `runs` of (first destination slot, tokens), keys/values [sum(tokens), H, D]."""
        if self.state is TransferState.FAILED:
            return  # already failed: finish() reports it
        if self.state is TransferState.PENDING:
            self.state, self._started = TransferState.TRANSFERRING, time.perf_counter()
        if self._layer is not None and layer != self._layer:
            self.flush()
        self._layer = layer
        self._pending.append((runs, keys, values))
        self._bytes += 2 * keys.numel() * keys.element_size()
        self._pieces += len(runs)

    def flush(self) -> None:
        """Send the pieces collected for the current layer; raises TransferError (and stays FAILED) on failure."""
        if not self._pending or self.state is TransferState.FAILED:
            return
        chunks, self._pending = self._pending, []
        runs = merge_runs([run for chunk_runs, _, _ in chunks for run in chunk_runs])  # as few as the rows allow
        keys = chunks[0][1] if len(chunks) == 1 else torch.cat([k for _, k, _ in chunks])  # [N, H, D]
        values = chunks[0][2] if len(chunks) == 1 else torch.cat([v for _, _, v in chunks])
        try:
            self._send_layer(self._layer, runs, keys, values)
        except Exception as e:
            raise self._fail(e) from None

    def finish(self, timeout_s: float = 60.0) -> TransferStats:
        try:
            self.flush()
            if self.state is TransferState.FAILED:
                raise self._error or TransferError("an earlier piece failed to send")
            self._finish(timeout_s)
        except TransferError:
            self.state = TransferState.FAILED
            raise
        self.state = TransferState.DONE
        return TransferStats(self._bytes, self._pieces, time.perf_counter() - self._started if self._started else 0.0)

    @abc.abstractmethod
    def _send_layer(self, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor) -> None:
        """One layer's pieces: `runs` of (first destination slot, tokens); keys/values [sum(tokens), H, D]."""

    @abc.abstractmethod
    def _finish(self, timeout_s: float) -> None:
        """Block until the receiver acknowledged everything; raise TransferError otherwise."""


class LoopbackSender(KVSender):
    def __init__(self, receiver: KVReceiver, request_id: str) -> None:
        super().__init__()
        self.receiver, self.request_id = receiver, request_id

    def _send_layer(self, layer, runs, keys, values) -> None:
        self.receiver.write_runs(self.request_id, layer, runs, keys, values)

    def _finish(self, timeout_s: float) -> None:
        pass


# ---- the parts each transport module provides (kvtransfer.transports)


class Links(Protocol):
    """What the hosting service lends a transport: gRPC channels and servers with the service's settings."""

    host: str
    options: KVOptions

    def channel(self, address: str) -> Any: ...

    def serve(self, services: list) -> str: ...


class Dialer(Protocol):
    """A prefill rank's way to push, reused across requests; made as `Dialer(rank, ranks, links)`."""

    def prepare(self, addresses: tuple[str, ...]) -> int:
        """Rank 0, before a push is published: a link number every rank then passes to `senders`."""

    def senders(self, addresses: tuple[str, ...], link: int, request_id: str, timeout_s: float) -> list[KVSender]:
        """One sender per decode rank."""

    def close(self) -> None: ...


class Shared(Protocol):
    """What every rank of a decode instance shares, hosted by rank 0 before its ranks start (a store)."""

    address: str

    def close(self) -> None: ...


class Endpoint(Protocol):
    """A decode rank's way to receive into its `KVReceiver`; made as
    `Endpoint(rank, ranks, receiver, links, shared_address)`."""

    address: str  # what the KV target lists for this rank

    def stop(self) -> None: ...
