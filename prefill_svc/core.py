"""The engine side of a prefill instance, testable without gRPC.

`prefill(request)` queues the prompt with `max_tokens=1` and a `PlanSink`: as
the step that completes the prompt runs, each layer's KV is cut by the plan
and handed to one sender per decode rank; the caller's thread then waits for
the first token and for every decode rank's acknowledgement. On a
context-parallel instance every rank pushes the tokens it stores (rank 0 here,
the others through `prefill_svc.push.push_kv`), and the push is complete only when
all ranks report success. A transfer that fails or times out is reported as
`kv_ok=False` (decode then recomputes) — the request itself does not fail.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from engine.core import EngineCore, StepOutput
from engine.cpu_lending import CpuLending
from engine.errors import Cancelled, Draining, PeerFailed
from engine.loop import EngineLoop
from engine.parallel.cp_choice import CPChoice
from engine.sampling_params import SamplingParams, TokenLogprobs
from kvtransfer.control import PushSpec
from kvtransfer.plan import DecodeLayout
from kvtransfer.transport import TransferError, TransferStats
from kvtransfer.transports import KVOptions
from mesh.telemetry import outgoing_metadata
from prefill_svc import push


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: int
    logprobs: TokenLogprobs | None
    kv_ok: bool
    kv_error: str
    transfer: TransferStats | None
    cached_tokens: int
    prefill_seconds: float
    cp_choice: CPChoice | None  # pass-KV or pass-Q and why (cp > 1)


class PrefillCore:
    def __init__(self, engine: EngineCore, *, host: str = "127.0.0.1", transfer_timeout_s: float = 60.0,
                 on_failure: Callable[[BaseException], None] | None = None, cpus: CpuLending | None = None,
                 options: KVOptions | None = None) -> None:
        """`host`: the interface this instance's KV pushes leave from; `on_failure(error)`: a step raised;
        `cpus`: the cores this instance holds while it works (engine.loop); `options`: what the settings tell
        the transports (the mooncake transport needs them)."""
        self.engine, self.transfer_timeout_s, self.on_failure = engine, transfer_timeout_s, on_failure
        self.links = push.DecodeLinks(0, engine.parallel.cp, host, options)
        self.total_requests = 0
        self.followers = range(1, engine.parallel.cp)  # the other CP ranks push their own tokens
        self.store = engine.executor.store if self.followers else None
        self._waiting: dict[str, Future] = {}
        self._loop = EngineLoop(engine, self._deliver_all, name="prefill-engine", on_failure=self._fail_waiting,
                                cpus=cpus)

    @property
    def failed(self) -> bool:
        """A step raised (a rank or the expert instance died): this instance serves nothing more."""
        return self._loop.error is not None

    def start(self) -> "PrefillCore":
        self._loop.start()
        return self

    def run_engine_here(self) -> None:
        """Drive the engine from the calling thread (a process's main thread) until it stops."""
        self._loop.run_here()

    def stop(self) -> None:
        self._loop.stop(on_stop=self._abort_all)
        self.engine.close()
        self.links.close()

    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, target: DecodeLayout,
                addresses: list[str], transport: str = "grpc_stream") -> PrefillResult:
        """`addresses`: per decode rank, where its endpoint of `transport` (kvtransfer.transports) is."""
        started = time.perf_counter()
        spec = PushSpec(num_tokens=len(prompt), num_kv_heads=self.engine.model_config.num_kv_heads,
                             block_size=self.engine.config.block_size, target=target, addresses=tuple(addresses),
                             timeout_s=self.transfer_timeout_s, transport=transport,
                             trace_context=tuple(outgoing_metadata()))
        try:
            spec = self.links.prepare(spec)
        except RuntimeError as e:  # e.g. the pairing store is unreachable: decode recomputes
            return self._prefill(request_id, prompt, params, None, f"cannot reach decode's KV endpoint: {e}", started)
        if self.store is not None:
            push.publish(self.store, request_id, spec)
        try:
            sink = self.links.sink(spec, request_id, len(self.engine.kv_cache))
            return self._prefill(request_id, prompt, params, sink, "", started)
        finally:
            if self.store is not None:
                push.forget(self.store, request_id, self.followers)

    def _prefill(self, request_id, prompt, params, sink, error: str, started: float) -> PrefillResult:
        """With `sink` None nothing is pushed (`error` says why)."""
        first: Future = Future()

        def add():
            seq = self.engine.add_request(request_id, prompt, dataclasses.replace(params, max_tokens=1), kv_sink=sink)
            self._waiting[request_id] = first
            self.total_requests += 1
            return seq

        seq = self._loop.call(add)
        out, choice = first.result()  # StepOutput, CPChoice | None
        prefill_seconds = time.perf_counter() - started
        stats = None
        try:
            if sink is not None:
                stats = sink.finish(self.transfer_timeout_s)
            if sink is not None and self.followers:
                theirs = push.collect(self.store, request_id, self.followers, self.transfer_timeout_s)
                stats = TransferStats(stats.bytes + theirs.bytes, stats.pieces + theirs.pieces,
                                      max(stats.seconds, theirs.seconds))
        except TransferError as e:
            stats, error = None, str(e)
        return PrefillResult(first_token=out.new_token_ids[0],
                             logprobs=out.new_logprobs[0] if out.new_logprobs else None,
                             kv_ok=not error, kv_error=error, transfer=stats,
                             cached_tokens=seq.num_cached_prompt_tokens, prefill_seconds=prefill_seconds,
                             cp_choice=choice)

    def cancel(self, request_id: str) -> bool:
        def run():
            found = self.engine.abort(request_id)
            waiting = self._waiting.pop(request_id, None)
            if waiting is not None:
                waiting.set_exception(Cancelled(f"request {request_id!r} was cancelled"))
            return found

        return self._loop.call(run)

    @property
    def in_flight(self) -> int:
        """Prompts queued or running."""
        return len(self._waiting)

    def status(self) -> dict[str, int]:
        blocks = self.engine.blocks
        return {"active_requests": len(self._waiting), "total_requests": self.total_requests,
                "kv_blocks_used": blocks.num_used_blocks, "kv_blocks_total": blocks.num_blocks}

    def _deliver_all(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: StepOutput) -> None:
        waiting = self._waiting.pop(out.request_id, None)
        if waiting is not None and out.new_token_ids:
            waiting.set_result((out, self.engine.last_cp_choices.get(out.request_id)))  # the step that just ran

    def _fail_waiting(self, error: BaseException) -> None:
        for request_id in list(self._waiting):
            self._waiting.pop(request_id).set_exception(PeerFailed(f"the prefill engine failed: {error!r}"))
        if self.on_failure is not None:
            self.on_failure(error)

    def _abort_all(self) -> None:
        for request_id in list(self._waiting):
            self.engine.abort(request_id)
            self._waiting.pop(request_id).set_exception(Draining("the prefill instance stopped"))
