"""The engine side of a decode instance, testable without gRPC.

One thread owns the `EngineCore` and loops: run the commands other threads
queued, then one engine step, then hand each request's output to its stream.
gRPC handlers call `reserve`, `generate`, `join` and `cancel` from their own
threads; each runs as a command on the engine thread (between steps). `generate`
and `join` return at once, a future of the queue the request's `TokenEvent`s go
to (tokens, then a final one): a queue of its own, or one shared by the requests
of a stream (`into`), where events come in lists of (request_id, event): one list
for all of a step's events there (one wake of the stream's thread per step).

KV arriving for reserved requests is written by this core's `receiver` from
transport threads under `kv_lock`; the engine thread takes the same lock to drop
a reservation, so a piece is never written into blocks already given back. A
transport may receive a layer straight into the cache (`KVReceiver.landing`);
when a reservation ends while a landing into it is open (a cancel mid-push), its
blocks stay held until the landing closes, then are freed on the engine thread. A
reservation is a lease: one not joined within `lease_s` of its reservation or of its
last KV piece (its prefill instance or router vanished) is cancelled and its blocks
freed; a router whose join comes too late has decode prefill the request itself.

Lifecycle: `start()` -> serving -> `stop()` (abort what is left, join the thread;
safe twice). Whether new work is admitted is the instance's call (`mesh.instance`);
`in_flight` counts what a drain waits for: running requests and reservations.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from engine.core import EngineCore, StepOutput
from engine.cpu_lending import CpuLending
from engine.errors import NoReservation, PeerFailed, ServingError
from engine.loop import EngineLoop
from engine.sampling_params import SamplingParams, TokenLogprobs
from engine.sequence import FinishReason, Sequence
from kvtransfer.control import RESERVATION, Reservation
from kvtransfer.transport import KVReceiver


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # the last event of a request has one
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, cached_prompt_tokens (last event)
    error: ServingError | None = None  # the engine failed: the request cannot go on here


@dataclass(frozen=True, slots=True)
class _Tagged:
    """A request's events into a queue shared with others, as lists of (request_id, event)."""

    shared: queue.Queue
    request_id: str

    def put(self, event: TokenEvent) -> None:
        self.shared.put([(self.request_id, event)])


class DecodeCore:
    def __init__(self, engine: EngineCore, shared_store=None,
                 on_failure: Callable[[BaseException], None] | None = None, lease_s: float = 30.0,
                 cpus: CpuLending | None = None) -> None:
        """`shared_store`: the store of a multi-rank instance, where reservations are published to its other
        ranks (each accepts pushed KV for its heads). `on_failure(error)`: a step raised (after the waiting
        streams got the error). `lease_s`: how long a reservation waits for its join. `cpus`: the cores this
        instance holds and borrows (engine.loop)."""
        self.engine, self.shared_store, self.on_failure, self.lease_s = engine, shared_store, on_failure, lease_s
        self._leases: dict[str, float] = {}  # reserved request id -> when its lease ends (on `clock`)
        self.clock: Callable[[], float] = time.monotonic  # the leases' (a test moves its own)
        self._expiring = threading.Event()  # set: stop the lease thread
        self.kv_lock = threading.Lock()
        self.reservations: dict[str, tuple[int, ...]] = {}  # request id -> reserved block table
        self.receiver = KVReceiver(engine.kv_cache, self.reserved, self.kv_lock, on_landed=self._landed)
        self._held: dict[str, list[int]] = {}  # ended reservation -> its blocks, while KV still lands in them
        self.total_requests = 0
        self._block_hashes: set[int] = set()  # the last snapshot of the prefix cache
        self._streams: dict[str, queue.Queue] = {}
        self._requests: dict[str, Sequence] = {}  # active: reserved or running
        self._loop = EngineLoop(engine, self._deliver_step, name="decode-engine", on_failure=self._fail_streams,
                                cpus=cpus)
        self._call = self._loop.call

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> "DecodeCore":
        self._loop.start()
        threading.Thread(target=self._expire_leases, name="decode-leases", daemon=True).start()
        return self

    def run_engine_here(self) -> None:
        """Drive the engine from the calling thread (a process's main thread) until it stops."""
        self._loop.run_here()

    def stop(self) -> None:
        self._expiring.set()
        self._loop.stop(on_stop=self._abort_all)
        self.engine.close()

    def _expire_leases(self) -> None:
        while not self._expiring.wait(min(1.0, self.lease_s / 4)):
            now = self.clock()
            for request_id in [r for r, end in list(self._leases.items()) if end <= now]:
                if self._leases.pop(request_id, None) is not None and not self.failed:
                    try:
                        self.cancel(request_id, only_reserved=True)  # a late join finds no reservation
                    except ServingError:
                        return  # the engine stopped meanwhile

    @property
    def failed(self) -> bool:
        """A step raised (a rank or the expert instance died): this instance serves nothing more."""
        return self._loop.error is not None

    @property
    def in_flight(self) -> int:
        """Requests running or reserved here."""
        return len(self._requests)

    @property
    def borrowed_steps(self) -> int:
        """Engine steps run on cores borrowed from idle instances as well (engine.cpu_lending)."""
        return self._loop.borrowed_steps

    def _fail_streams(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(TokenEvent([], "", error=PeerFailed(f"the decode engine failed: {error!r}")))
        self._streams.clear()
        self._requests.clear()
        if self.on_failure is not None:
            self.on_failure(error)

    def _abort_all(self) -> None:
        for request_id in list(self._requests):
            self.engine.abort(request_id)
            self._deliver(StepOutput(request_id, [], "", FinishReason.ABORT, []))

    # ---- requests (any thread) ---------------------------------------------------------

    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[tuple[int, ...], int]:
        """Blocks for a prompt prefilled elsewhere: (block table, tokens already cached here)."""
        def run():
            seq = self.engine.reserve(request_id, prompt, params)
            with self.kv_lock:
                self.reservations[request_id] = tuple(seq.block_table)
            self._leases[request_id] = self.clock() + self.lease_s
            if self.shared_store is not None:
                self.shared_store.put(RESERVATION.key(request_id), Reservation(tuple(seq.block_table)))
            self._requests[request_id] = seq
            return tuple(seq.block_table), seq.num_cached_prompt_tokens

        return self._call(run)

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams, resume: tuple[int, ...] = (),
                 into: queue.Queue | None = None) -> Future:
        """Prefill here and decode: the whole request on this instance (after `resume`, the tokens it already
        generated elsewhere)."""
        def run():
            seq = self.engine.add_request(request_id, prompt, params, resume_token_ids=resume)
            self._requests[request_id] = seq
            return self._track(seq.request_id, into)

        return self._loop.submit(run)

    def join(self, request_id: str, first_token: int | None, logprobs: TokenLogprobs | None = None,
             into: queue.Queue | None = None) -> Future:
        """The reserved request's KV arrived (`first_token` and its `logprobs` from prefill), or not (None:
        recompute here)."""
        def run():
            self._leases.pop(request_id, None)
            with self.kv_lock:
                if self.reservations.pop(request_id, None) is None:
                    raise NoReservation(f"request_id {request_id!r} has no reservation")
                landing = self._hold_if_landing(request_id)
            self._unpublish(request_id)
            stream = self._track(request_id, into)
            if first_token is None or landing:  # KV still arriving at the join is not trusted: recompute
                self.engine.recompute(request_id)
            else:
                self._deliver(self.engine.join(request_id, first_token, logprobs))
            return stream

        return self._loop.submit(run)

    def reserved(self, request_id: str) -> tuple[int, ...] | None:
        """The reservation's block table (None: none), for the KV receiver: each piece that arrives renews
        the lease, so a push in progress never outlives it."""
        table = self.reservations.get(request_id)
        if table is not None and request_id in self._leases:
            self._leases[request_id] = self.clock() + self.lease_s
        return table

    def cancel(self, request_id: str, only_reserved: bool = False) -> bool:
        """Abort the request and free its blocks (`only_reserved`: only if it is still waiting for its KV)."""
        def run():
            self._leases.pop(request_id, None)
            if only_reserved and request_id not in self.reservations:
                return False  # joined meanwhile: it runs on
            with self.kv_lock:
                reserved = self.reservations.pop(request_id, None) is not None
                self._hold_if_landing(request_id)
                found = self.engine.abort(request_id)
            if reserved:
                self._unpublish(request_id)
            if found:
                self._deliver(StepOutput(request_id, [], "", FinishReason.ABORT, []))
            self._requests.pop(request_id, None)
            return found

        return False if self.failed else self._call(run)  # a failed engine has freed everything already

    def _hold_if_landing(self, request_id: str) -> bool:
        """Engine thread, under `kv_lock`, as the reservation ends: True, with its blocks held from reuse until
        `_landed`, when KV is landing in them now."""
        if not self.receiver.landings(request_id):
            return False
        blocks = list(self._requests[request_id].block_table)
        self.engine.blocks.hold(blocks)
        self._held[request_id] = blocks
        return True

    def _landed(self, request_id: str) -> None:
        """The last landing into an ended reservation closed (a transport thread): free what it held."""
        def release() -> None:
            blocks = self._held.pop(request_id, None)
            if blocks is not None:
                self.engine.blocks.free(blocks)

        try:
            self._loop.submit(release)
        except ServingError:
            pass  # the engine stopped: nothing is reused any more

    def cached_block_hashes(self, wait_s: float = 0.2) -> set[int]:
        """Hashes of the full KV blocks in the prefix cache, read on the engine thread between steps; while a
        long step runs, the last snapshot after `wait_s` (the heartbeat must not wait out its TTL). None once
        failed."""
        if self.failed:
            return set()

        def snapshot() -> None:
            self._block_hashes = set(self.engine.blocks.cached)

        try:
            self._loop.submit(snapshot).result(timeout=wait_s)
        except (TimeoutError, ServingError):  # a step is running, or the engine stopped meanwhile
            pass
        return self._block_hashes

    def status(self) -> dict[str, int]:
        blocks = self.engine.blocks
        return {"active_requests": len(self._requests), "total_requests": self.total_requests,
                "kv_blocks_used": blocks.num_used_blocks, "kv_blocks_total": blocks.num_blocks}

    # ---- on the engine thread -------------------------------------------------------------

    def _track(self, request_id: str, into: queue.Queue | None) -> queue.Queue:
        self.total_requests += 1
        self._streams[request_id] = _Tagged(into, request_id) if into is not None else queue.Queue()
        return into if into is not None else self._streams[request_id]

    def _deliver(self, out: StepOutput) -> None:
        self._deliver_step([out])

    def _deliver_step(self, outputs: list[StepOutput]) -> None:
        """Each output to its request's stream: the events bound for one shared queue as one list."""
        shared: dict[int, tuple[queue.Queue, list]] = {}  # id(queue) -> (queue, its events)
        for out in outputs:
            seq = self._requests.get(out.request_id)
            stream = self._streams.get(out.request_id)
            if seq is None or stream is None:
                continue
            reason = out.finish_reason.value if out.finish_reason else None
            usage = None
            if reason:
                usage = {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": len(seq.output_token_ids),
                         "cached_prompt_tokens": seq.num_cached_prompt_tokens}
                del self._requests[out.request_id], self._streams[out.request_id]
            event = TokenEvent(out.new_token_ids, out.text_delta, out.new_logprobs, reason, usage)
            if isinstance(stream, _Tagged):
                shared.setdefault(id(stream.shared), (stream.shared, []))[1].append((stream.request_id, event))
            else:
                stream.put(event)
        for events, batch in shared.values():
            events.put(batch)

    def _unpublish(self, request_id: str) -> None:
        """Other ranks keep accepting pieces until the next step plan names the reservation as ended."""
        if self.shared_store is not None:
            self.shared_store.delete(RESERVATION.key(request_id))

