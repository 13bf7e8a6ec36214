"""The engine side of a decode instance, testable without gRPC.

One thread owns the `EngineCore` and loops: run the commands other threads
queued, then one engine step, then hand each request's output to its stream.
gRPC handlers call `reserve`, `generate`, `join` and `cancel` from their own
threads; each runs as a command on the engine thread (between steps) and
`generate`/`join` return the request's queue of `Event`s: tokens, then a final one.

KV arriving for reserved requests is written by a `KVReceiver` from transport
threads under `kv_lock`; the engine thread takes the same lock to drop a
reservation, so a piece is never written into blocks already given back.

Lifecycle: `start()` -> serving -> `drain()` (refuse new requests, finish the
running ones) -> `stop()` (abort what is left, join the thread; safe twice).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from decode_svc.follower import reservation_key
from engine.core import EngineCore, RequestError, StepOutput
from engine.loop import EngineLoop
from engine.sampler import SamplingParams, TokenLogprobs
from engine.sequence import FinishReason, Sequence


@dataclass(frozen=True, slots=True)
class Event:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # the last event of a request has one
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, cached_prompt_tokens (last event)
    error: str | None = None  # the engine failed: the request cannot go on


class DecodeCore:
    def __init__(self, engine: EngineCore, shared_store=None) -> None:
        """`shared_store`: the store of a multi-rank instance, where reservations are published to its other
        ranks (each accepts pushed KV for its heads)."""
        self.engine, self.shared_store = engine, shared_store
        self.kv_lock = threading.Lock()
        self.reservations: dict[str, tuple[int, ...]] = {}  # request id -> reserved block table
        self.total_requests = 0
        self.draining = False
        self._streams: dict[str, queue.Queue] = {}
        self._requests: dict[str, Sequence] = {}  # active: reserved or running
        self._loop = EngineLoop(engine, self._deliver, name="decode-engine", on_failure=self._fail_streams)
        self._call = self._loop.call

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> "DecodeCore":
        self._loop.start()
        return self

    def drain(self) -> None:
        self.draining = True

    def stop(self) -> None:
        self._loop.stop(on_stop=self._abort_all)
        self.engine.close()

    @property
    def failed(self) -> bool:
        """A step raised (a rank or the expert instance died): this instance serves nothing more."""
        return self._loop.error is not None

    def _fail_streams(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(Event([], "", error=f"the decode engine failed: {error!r}"))
        self._streams.clear()
        self._requests.clear()

    def _abort_all(self) -> None:
        for request_id in list(self._requests):
            self.engine.abort(request_id)
            self._deliver(StepOutput(request_id, [], "", FinishReason.ABORT, []))

    # ---- requests (any thread) ---------------------------------------------------------

    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[tuple[int, ...], int]:
        """Blocks for a prompt prefilled elsewhere: (block table, tokens already cached here)."""
        def run():
            self._refuse_when_draining()
            seq = self.engine.reserve(request_id, prompt, params)
            with self.kv_lock:
                self.reservations[request_id] = tuple(seq.block_table)
            if self.shared_store is not None:
                self.shared_store.set(reservation_key(request_id), ",".join(map(str, seq.block_table)))
            self._requests[request_id] = seq
            return tuple(seq.block_table), seq.num_cached_prompt_tokens

        return self._call(run)

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> queue.Queue:
        """Prefill here and decode: the whole request on this instance."""
        def run():
            self._refuse_when_draining()
            seq = self.engine.add_request(request_id, prompt, params)
            self._requests[request_id] = seq
            self._track(seq.request_id)
            return self._streams[request_id]

        return self._call(run)

    def join(self, request_id: str, first_token: int | None) -> queue.Queue:
        """The reserved request's KV arrived (`first_token` from prefill), or not (None: recompute here)."""
        def run():
            with self.kv_lock:
                if self.reservations.pop(request_id, None) is None:
                    raise RequestError(f"request_id {request_id!r} has no reservation")
            self._unpublish(request_id)
            stream = self._track(request_id)
            if first_token is None:
                self.engine.recompute(request_id)
            else:
                self._deliver(self.engine.join(request_id, first_token))
            return stream

        return self._call(run)

    def cancel(self, request_id: str) -> bool:
        def run():
            with self.kv_lock:
                reserved = self.reservations.pop(request_id, None) is not None
                found = self.engine.abort(request_id)
            if reserved:
                self._unpublish(request_id)
            if found:
                self._deliver(StepOutput(request_id, [], "", FinishReason.ABORT, []))
            self._requests.pop(request_id, None)
            return found

        return False if self.failed else self._call(run)  # a failed engine has freed everything already

    def cached_block_hashes(self) -> set[int]:
        """Hashes of the full KV blocks in the prefix cache (read on the engine thread); none once failed."""
        return set() if self.failed else self._call(lambda: set(self.engine.blocks.cached))

    def status(self) -> dict[str, int]:
        blocks = self.engine.blocks
        return {"active_requests": len(self._requests), "total_requests": self.total_requests,
                "kv_blocks_used": blocks.num_used_blocks, "kv_blocks_total": blocks.num_blocks}

    # ---- on the engine thread -------------------------------------------------------------

    def _track(self, request_id: str) -> queue.Queue:
        self.total_requests += 1
        return self._streams.setdefault(request_id, queue.Queue())

    def _deliver(self, out: StepOutput) -> None:
        seq = self._requests.get(out.request_id)
        stream = self._streams.get(out.request_id)
        if seq is None or stream is None:
            return
        reason = out.finish_reason.value if out.finish_reason else None
        usage = None
        if reason:
            usage = {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": len(seq.output_token_ids),
                     "cached_prompt_tokens": seq.num_cached_prompt_tokens}
            del self._requests[out.request_id], self._streams[out.request_id]
        stream.put(Event(out.new_token_ids, out.text_delta, out.new_logprobs, reason, usage))

    def _unpublish(self, request_id: str) -> None:
        """Other ranks keep accepting pieces until the next step plan names the reservation as ended."""
        if self.shared_store is not None:
            self.shared_store.delete_key(reservation_key(request_id))

    def _refuse_when_draining(self) -> None:
        if self.draining:
            raise RuntimeError("this decode instance is draining")

