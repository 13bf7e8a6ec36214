"""Pushing a prompt's KV from every rank of a prefill instance, over any transport.

`DecodeLinks` is one rank's way to reach decode ranks: one dialer per transport of
`kvtransfer.transports`, made on first use (rank 0 prepares a push, e.g. claims the torch_p2p pair, and
the link it gets goes in the spec).

Ranks 1..N-1 of a context-parallel instance add this to following the step plans: each pushes the KV
of the prompt tokens it stores, layer by layer, straight to the decode ranks.

Rank 0 publishes a request's push (`PushSpec`: the decode layout and its rank addresses) in the
instance's store (`kvtransfer.control.PUSH`) before queueing the request. When a step plan lists the request in
`pushes`, a follower plans its own share (`PlanSink` over the slots it stores) and sends each layer as
the layer finishes; after the last layer it waits for the acknowledgements off the step's thread and
reports a `PushResult`. Each follower's push is a `kvtransfer.push.rank` span in the
request's trace (the spec carries the W3C context of rank 0's `prefill.run`). Rank 0 (`PrefillCore`)
answers READY only when its own push and every follower's succeeded, and removes the keys.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading

from opentelemetry import propagate, trace

from engine.parallel.control import Store
from kvtransfer import transports
from kvtransfer.control import PUSH, PUSH_RESULT, PushResult, PushSpec
from kvtransfer.sink import PlanSink
from kvtransfer.transport import Dialer, TransferError, TransferStats
from mesh import rpc
from mesh.telemetry import setup_tracing, tracer


class DecodeLinks:
    """One prefill rank's connections to decode instances, reused across requests (thread-safe)."""

    def __init__(self, rank: int, ranks: int, host: str, options: transports.KVOptions | None = None) -> None:
        self.rank, self.ranks, self.links = rank, ranks, rpc.Links(host, options=options)
        self._dialers: dict[str, Dialer] = {}
        self._lock = threading.Lock()

    def dialer(self, transport: str) -> Dialer:
        with self._lock:
            if transport not in self._dialers:
                parts = transports.by_name(transport).load()
                self._dialers[transport] = parts.dialer(self.rank, self.ranks, self.links)
            return self._dialers[transport]

    def prepare(self, spec: PushSpec) -> PushSpec:
        """Rank 0, before publishing the push (torch_p2p claims the pair it goes over)."""
        return dataclasses.replace(spec, link=self.dialer(spec.transport).prepare(spec.addresses))

    def sink(self, spec: PushSpec, request_id: str, num_layers: int) -> PlanSink:
        senders = self.dialer(spec.transport).senders(spec.addresses, spec.link, request_id, spec.timeout_s)
        return PlanSink(num_tokens=spec.num_tokens, num_kv_heads=spec.num_kv_heads, block_size=spec.block_size,
                        num_layers=num_layers, target=spec.target, senders=senders)

    def close(self) -> None:
        for dialer in self._dialers.values():
            dialer.close()
        self.links.close()


def publish(store: Store, request_id: str, spec: PushSpec) -> None:
    store.put(PUSH.key(request_id), spec)


def collect(store: Store, request_id: str, ranks: range, timeout_s: float) -> TransferStats:
    """The followers' pushes of one request, summed; raises TransferError naming the first that failed."""
    keys = [PUSH_RESULT.key(request_id, r) for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except TimeoutError:
        raise TransferError(f"prefill ranks {list(ranks)} did not report their KV push within {timeout_s} s") from None
    stats = [store.get(key).stats(rank) for rank, key in zip(ranks, keys)]
    return TransferStats(sum(s.bytes for s in stats), sum(s.pieces for s in stats),
                         max((s.seconds for s in stats), default=0.0))


def forget(store: Store, request_id: str, ranks: range) -> None:
    for key in [PUSH.key(request_id)] + [PUSH_RESULT.key(request_id, r) for r in ranks]:
        store.delete(key)


def push_kv(rank: int, store: Store, runner, host: str, *, trace_spec: str = "none",
            options: transports.KVOptions | None = None):
    """The `follower_hook` of EngineCore: push this rank's share of every pushed prompt from its `host`;
    returns the before-step hook. Pass it as `Call.of(push_kv, trace_spec=..., options=...)`."""
    setup_tracing(trace_spec, "prefill")
    links = DecodeLinks(rank, runner.cp_size, host, options)  # the prefill instance's ranks are its CP ranks
    last_layer = len(runner.kv_cache) - 1

    def before_step(plan):
        if not plan.pushes:
            return None
        pushes = []
        for index, request_id in plan.pushes:
            spec = store.get(PUSH.key(request_id))
            span = tracer().start_span("kvtransfer.push.rank", context=propagate.extract(dict(spec.trace_context)),
                                       attributes={"prefill_rank": rank, "transport": spec.transport})
            sink = links.sink(spec, request_id, last_layer + 1)
            pushes.append((request_id, spec, sink, plan.chunks[index].block_table, span))

        def on_layer(layer: int) -> None:
            for _, _, sink, table, _ in pushes:
                sink.push_layer(layer, *runner.kv_cache[layer], table, runner.kv_stripe)
            if layer == last_layer:  # wait for the acknowledgements without holding up the group
                for request_id, spec, sink, _, span in pushes:
                    threading.Thread(target=_report, args=(store, request_id, rank, sink, spec.timeout_s, span),
                                     daemon=True).start()

        return on_layer

    return before_step


def _report(store: Store, request_id: str, rank: int, sink: PlanSink, timeout_s: float, span: trace.Span) -> None:
    try:
        result = PushResult.of(sink.finish(timeout_s))
    except Exception as e:  # noqa: BLE001 - every failure is reported to rank 0, which decides
        result = PushResult(error=str(e) or type(e).__name__)
    store.put(PUSH_RESULT.key(request_id, rank), result)
    span.set_attributes({"bytes": result.bytes, "ok": not result.error, "error": result.error})
    span.end()
