"""KV transfer by Mooncake's Transfer Engine: prefill ranks write each layer straight into decode's cache with
one-sided batched writes (`tcp` anywhere, `rdma` on clusters; a CUDA build registers device memory the same way).

Each decode rank registers its KV cache with a Transfer Engine of its own once (its segment, named
`host:port`, found by Mooncake's P2P handshake: no metadata server) and serves `KVWrite`, the grants:

    prefill rank                                   decode rank
    Open(request, layers, runs, dtype)  ------->   checks the runs lie in the request's reservation, holds
                                        <-------   those blocks back from reuse; Grant(segment, addresses)
    batched writes, layer by layer      =======>   (Mooncake writes them into the cache; decode's threads idle)
    Done(bytes)                         ------->
                                        <-------   Ack; the hold is let go (so it is when the stream breaks)

A prefill rank knows only the addresses decode granted for its own runs, so it cannot write outside the
request's reservation; decode holds the blocks until the stream ends (`KVReceiver.holding`), so a
reservation cancelled mid-write is not reused under the write. A decode rank that dies fails the writes
(`TransferError`: decode recomputes, as after any failed push); a prefill rank that dies ends its stream,
and the reservation's lease frees the blocks.

A prefill rank writes a layer's rows from where they lie when they are one range of memory (on `rdma`, memory
its engine registered: its KV cache, registered when first written from, or its staging pool; on `tcp` the
engine reads any memory of the process), else it gathers them into a pooled staging buffer first
(`layer_buffers`).

Mooncake's listeners (its handshake port and its tcp transport's) bind every interface, whatever host
they are given: run this transport on a network only the mesh reaches (the README's security section).

The transport entry `mooncake` (`kvtransfer.transports`); `pip install 'infermesh[mooncake]'`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable

import grpc
import torch

from kvtransfer.grpc_stream import DTYPES_BY_WIRE, WIRE_DTYPES, shared  # noqa: F401 - `shared`: every rank on its own
from kvtransfer.shm_arena import size_class
from kvtransfer.transport import CPU, KVReceiver, KVSender, PieceRejected, TransferError, TransferState, merge_runs
from kvtransfer.transports import KVOptions
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)
METADATA = "P2PHANDSHAKE"  # segments are found by asking their owner: no etcd or metadata server
POOL_BYTES = 256 << 20  # idle staging buffers kept registered, per prefill rank
_END = object()


# ---- one Transfer Engine per process


class Engine:
    """This process's Transfer Engine and the memory it registered (thread-safe)."""

    def __init__(self, host: str, options: KVOptions) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake logs each handshake at INFO
        from mooncake.engine import TransferEngine  # the optional dependency: infermesh[mooncake]

        self.te = TransferEngine()
        if self.te.initialize(host, METADATA, options.mooncake_protocol, options.mooncake_devices) != 0:
            raise TransferError(f"Mooncake's Transfer Engine did not start on {host} with protocol "
                                f"{options.mooncake_protocol} (devices {options.mooncake_devices or 'any'})")
        self.segment = f"{host}:{self.te.get_rpc_port()}"
        self.reads_any_memory = options.mooncake_protocol == "tcp"  # rdma reads registered memory only
        self._ranges: list[tuple[int, int]] = []  # (address, bytes) registered
        self._lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> None:
        with self._lock:
            if self.te.register_memory(address, nbytes) != 0:
                raise TransferError(f"Mooncake could not register {nbytes} bytes at {address:#x}")
            self._ranges.append((address, nbytes))

    def unregister(self, address: int) -> None:
        with self._lock:
            self._ranges = [r for r in self._ranges if r[0] != address]
            self.te.unregister_memory(address)

    def registered(self, address: int, nbytes: int) -> bool:
        with self._lock:
            return any(a <= address and address + nbytes <= a + n for a, n in self._ranges)

    def submit(self, segment: str, sources: list[int], destinations: list[int], lengths: list[int]) -> int:
        """Start one batch of writes; its id."""
        batch = self.te.batch_transfer_async_write(segment, sources, destinations, lengths)
        if not batch:
            raise TransferError(f"Mooncake could not start writing {sum(lengths)} bytes to {segment}")
        return batch

    def wait(self, batches: list[int], segment: str) -> None:
        """Until every batch completed (Mooncake times a batch out after 30 s + 1 s a GB: MC_TRANSFER_TIMEOUT)."""
        if batches and self.te.get_batch_transfer_status(batches) != 0:
            raise TransferError(f"Mooncake's writes to {segment} failed")


_engines: dict[tuple[str, KVOptions], Engine] = {}
_engines_lock = threading.Lock()


def engine(host: str, options: KVOptions | None) -> Engine:
    """The process's engine for `host` and `options`, started on first use."""
    if options is None:
        raise TransferError("the mooncake transport needs its settings (KVOptions) from the hosting service")
    with _engines_lock:
        if (host, options) not in _engines:
            _engines[host, options] = Engine(host, options)
        return _engines[host, options]


def storage_range(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


# ---- prefill: the writer


class Staging:
    """Registered buffers for gathered layers, pooled by size class (one rank's; taken on its engine thread,
    given back where pushes finish)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._free: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
        self._idle = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get((size, device))
            if free:
                self._idle -= size
                return free.pop()
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.engine.register(buffer.data_ptr(), size)
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._idle + buffer.numel() <= POOL_BYTES:
                self._idle += buffer.numel()
                self._free.setdefault((buffer.numel(), buffer.device), []).append(buffer)
                return
        self.drop(buffer)

    def drop(self, buffer: torch.Tensor) -> None:
        self.engine.unregister(buffer.data_ptr())


class MooncakeSender(KVSender):
    """One request's writes to one decode rank: its grant stream opened by the first layer."""

    def __init__(self, engine: Engine, staging: Staging, channel: grpc.Channel, request_id: str, dst_rank: int,
                 timeout_s: float) -> None:
        super().__init__()
        self.engine, self.staging, self.request_id, self.dst_rank = engine, staging, request_id, dst_rank
        self.timeout_s = timeout_s
        self._stub = internal_pb2_grpc.KVWriteStub(channel)
        self._requests: queue.Queue = queue.Queue()
        self._responses = None  # the stream's answers, once opened
        self._grant: internal_pb2.KVWriteGrant | None = None
        self._first_layer, self._layers, self._runs = 0, 0, []
        self._batches: list[int] = []  # writes started and not yet waited for
        self._reading: list[torch.Tensor] = []  # what they read: kept alive until they are done
        self._staged: list[torch.Tensor] = []  # staging buffers they read, back to the pool once they are done

    def layer_buffers(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device = CPU):
        nbytes = 2 * shape[0] * shape[1] * shape[2] * dtype.itemsize
        self._staged.append(self.staging.take(nbytes, device))
        kv = self._staged[-1][:nbytes].view(dtype).view(2, *shape)
        return kv[0], kv[1]

    def _send_layer(self, layer: int, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor) -> None:
        if self._grant is None:
            self._ask_grant(layer, runs, keys.dtype)
        if runs != self._runs or not self._first_layer <= layer < self._first_layer + self._layers:
            raise TransferError(f"layer {layer} with runs {runs} was not granted (layers {self._first_layer}.."
                                f"{self._first_layer + self._layers - 1}, runs {self._runs})")
        row = keys.shape[1] * keys.shape[2] * keys.element_size()
        sources, destinations, lengths = [], [], []
        at = (layer - self._first_layer) * len(runs)
        for source, granted in zip(self._sources(keys, values), (self._grant.keys, self._grant.values)):
            first = 0
            for i, (_, n) in enumerate(runs):
                sources.append(source + first * row)
                destinations.append(granted[at + i])
                lengths.append(n * row)
                first += n
        self._batches.append(self.engine.submit(self._grant.segment, sources, destinations, lengths))
        self._reading += (keys, values)

    def settle(self) -> None:
        """Wait for the writes started so far: they read the cache, reused after the step (a failure leaves
        this sender FAILED: `finish` raises it)."""
        batches, self._batches, self._reading = self._batches, [], []
        try:
            self.engine.wait(batches, self._grant.segment if self._grant else "")
        except TransferError as e:
            if self.state is not TransferState.FAILED:
                self._fail(e)

    def _sources(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
        """Where to write the keys and values from: where they lie when each is one registered range (a view of
        the cache registers the cache, once), else copies in staging."""
        if all(map(self._registered, (keys, values))):
            return keys.data_ptr(), values.data_ptr()
        staged = self.layer_buffers(tuple(keys.shape), keys.dtype, keys.device)
        return tuple(t.data_ptr() if self._registered(t) else s.copy_(t).data_ptr()
                     for t, s in zip((keys, values), staged))

    def _registered(self, t: torch.Tensor) -> bool:
        """Whether the engine can write `t` from where it lies (registering the cache it is a view of)."""
        if not t.is_contiguous():
            return False
        if self.engine.reads_any_memory or self.engine.registered(t.data_ptr(), t.nbytes):
            return True
        address, nbytes = storage_range(t)
        if nbytes > t.nbytes:  # a view of the sink's: of the KV cache, which lives as long as the engine
            self.engine.register(address, nbytes)
            return True
        return False

    def _ask_grant(self, layer: int, runs: list[tuple[int, int]], dtype: torch.dtype) -> None:
        last = self.last_layer if self.last_layer is not None and self.last_layer >= layer else layer
        self._first_layer, self._layers, self._runs = layer, last - layer + 1, runs
        self._requests.put(internal_pb2.KVWriteRequest(open=internal_pb2.KVWriteOpen(
            request_id=self.request_id, dst_rank=self.dst_rank, first_layer=layer, last_layer=last,
            dst_slots=[s for s, _ in runs], run_tokens=[n for _, n in runs], dtype=WIRE_DTYPES[dtype])))
        self._responses = self._stub.Write(iter(self._requests.get, _END), timeout=self.timeout_s)
        grant = self._next("a grant").grant
        expected = self._layers * len(runs)
        if len(grant.keys) != expected or len(grant.values) != expected:
            raise TransferError(f"decode rank {self.dst_rank} granted {len(grant.keys)} addresses, not {expected}")
        self._grant = grant

    def _next(self, what: str) -> internal_pb2.KVWriteResponse:
        try:
            return next(self._responses)
        except StopIteration:
            raise TransferError(f"KV write to rank {self.dst_rank} ended before {what}") from None
        except grpc.RpcError as e:
            raise TransferError(f"KV write to rank {self.dst_rank} failed: {e.code().name}: {e.details()}") from None

    def _finish(self, timeout_s: float) -> None:
        if self._responses is None:
            return  # nothing was written to this rank
        self.settle()
        if self.state is TransferState.FAILED:
            raise self._error
        self._requests.put(internal_pb2.KVWriteRequest(done=internal_pb2.KVWriteDone(bytes=self._bytes)))
        self._next("its acknowledgement")

    def finish(self, timeout_s: float = 60.0):
        try:
            return super().finish(timeout_s)
        finally:
            self.settle()  # writes a failure left running read our memory and land in blocks decode holds
            self._requests.put(_END)
            if self._responses is not None and self.state is TransferState.FAILED:
                self._responses.cancel()  # decode lets its hold go now
            keep = self.state is TransferState.DONE  # else a write Mooncake timed out may still read them
            for buffer in self._staged:
                self.staging.give_back(buffer) if keep else self.staging.drop(buffer)
            self._staged = []


class Dialer:
    """A prefill rank's writes: its process's Transfer Engine, its staging pool, grant streams over the
    service's pooled channels."""

    def __init__(self, rank: int, ranks: int, links) -> None:
        self.links = links
        self.engine = engine(links.host, links.options)
        self.staging = Staging(self.engine)

    def prepare(self, addresses: tuple[str, ...]) -> int:
        return 0  # nothing to set up ahead of a push

    def senders(self, addresses: tuple[str, ...], link: int, request_id: str, timeout_s: float) -> list[KVSender]:
        return [MooncakeSender(self.engine, self.staging, self.links.channel(a), request_id, r, timeout_s)
                for r, a in enumerate(addresses)]

    def close(self) -> None:
        pass  # the engine serves the process; the channels are the service's


# ---- decode: the grants


class WriteService(internal_pb2_grpc.KVWriteServicer):
    """Grants one decode rank's cache to prefill ranks' writes, run by run (a refusal ends the stream:
    NOT_FOUND for an unknown reservation, INVALID_ARGUMENT otherwise). `segment()`: the rank's Transfer
    Engine segment, its cache registered (started by the first grant)."""

    def __init__(self, receiver: KVReceiver, rank: int, segment: Callable[[], str]) -> None:
        self.receiver, self.rank, self.segment = receiver, rank, segment

    def Write(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or not first.HasField("open"):
            raise PieceRejected("a KV write stream begins with `open`")
        o = first.open
        dtype = DTYPES_BY_WIRE.get(o.dtype)
        if o.dst_rank != self.rank:
            raise PieceRejected(f"KV write for rank {o.dst_rank} sent to rank {self.rank}")
        if dtype is None or len(o.dst_slots) != len(o.run_tokens) or o.last_layer < o.first_layer:
            raise PieceRejected(f"KV write open must name a dtype, as many dst_slots as run_tokens and "
                                f"first_layer <= last_layer, got {o.dtype}, {len(o.dst_slots)}, {len(o.run_tokens)}, "
                                f"{o.first_layer}..{o.last_layer}")
        runs = merge_runs(list(zip(o.dst_slots, o.run_tokens)))
        layers = range(o.first_layer, o.last_layer + 1)
        r = self.receiver
        shape = (sum(n for _, n in runs), r.num_heads, r.head_dim)
        with r.holding(o.request_id, layers, runs, shape, dtype):
            row = r.num_heads * r.head_dim * dtype.itemsize
            keys, values = [], []
            for layer in layers:
                k_cache, v_cache = r.kv_cache[layer]
                keys += [k_cache.data_ptr() + slot * row for slot, _ in runs]
                values += [v_cache.data_ptr() + slot * row for slot, _ in runs]
            grant = internal_pb2.KVWriteGrant(segment=self.segment(), keys=keys, values=values)
            yield internal_pb2.KVWriteResponse(grant=grant)
            done = next(request_iterator, None)  # the writes are over, or the stream broke
            if done is None or not done.HasField("done"):
                raise PieceRejected("a KV write stream ends with `done`")
        yield internal_pb2.KVWriteResponse(ack=internal_pb2.PushResponse(bytes=done.done.bytes,
                                                                         pieces=len(layers) * len(runs)))


class Endpoint:
    """A decode rank's `KVWrite` server; its Transfer Engine starts, and registers the cache, with the first
    grant (so an instance no prefill writes to over Mooncake opens none of Mooncake's listeners)."""

    def __init__(self, rank: int, ranks: int, receiver: KVReceiver, links, shared_address: str | None) -> None:
        self.host, self.options, self.cache = links.host, links.options, receiver.kv_cache
        self._engine: Engine | None = None
        self._registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self.address = links.serve([(internal_pb2_grpc.add_KVWriteServicer_to_server,
                                     WriteService(receiver, rank, self.segment), "infermesh.v1.KVWrite")])

    def segment(self) -> str:
        with self._lock:
            if self._engine is None:
                started = engine(self.host, self.options)
                for address, nbytes in sorted({storage_range(t) for layer in self.cache for t in layer}):
                    started.register(address, nbytes)
                    self._registered.append((address, nbytes))
                self._engine = started
            return self._engine.segment

    def stop(self) -> None:
        with self._lock:
            for address, _ in self._registered:
                self._engine.unregister(address)
            self._registered = []
