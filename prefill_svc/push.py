"""Pushing a prompt's KV from every rank of a prefill instance, over any transport.

`DecodeLinks` is one rank's way to reach decode ranks: one dialer per transport of
`kvtransfer.transports`, made on first use (rank 0 prepares a push, e.g. claims the torch_p2p pair, and
the link it gets goes in the spec).

Ranks 1..N-1 of a context-parallel instance add this to following the step plans: each pushes the KV
of the prompt tokens it stores, layer by layer, straight to the decode ranks.

Rank 0 publishes a request's push (`PushSpec`: the decode layout and its rank addresses) in the
instance's store as `push/<id>` before queueing the request. When a step plan lists the request in
`pushes`, a follower plans its own share (`PlanSink` over the slots it stores) and sends each layer as
the layer finishes; after the last layer it waits for the acknowledgements off the step's thread and
reports `push-result/<id>/<rank>`. Each follower's push is a `kvtransfer.push.rank` span in the
request's trace (the spec carries the W3C context of rank 0's `prefill.run`). Rank 0 (`PrefillCore`)
answers READY only when its own push and every follower's succeeded, and removes the keys.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pickle
import threading
from dataclasses import dataclass

from opentelemetry import propagate, trace

from kvtransfer import transports
from kvtransfer.plan import DecodeLayout
from kvtransfer.sink import PlanSink
from kvtransfer.transport import TransferError, TransferStats
from mesh import rpc
from mesh.telemetry import setup_tracing, tracer


@dataclass(frozen=True, slots=True)
class PushSpec:
    num_tokens: int
    num_kv_heads: int
    block_size: int  # the prefill instance's
    target: DecodeLayout
    addresses: tuple[str, ...]  # per decode rank, where its transport's endpoint is
    timeout_s: float
    transport: str = "grpc_stream"  # a name in kvtransfer.transports
    link: int = 0  # what rank 0's dialer prepared (torch_p2p: the pair number it claimed)
    trace_context: tuple[tuple[str, str], ...] = ()  # W3C headers of the span the push belongs to


class DecodeLinks:
    """One prefill rank's connections to decode instances, reused across requests (thread-safe)."""

    def __init__(self, rank: int, ranks: int, host: str) -> None:
        self.rank, self.ranks, self.links = rank, ranks, rpc.Links(host)
        self._dialers: dict[str, object] = {}
        self._lock = threading.Lock()

    def dialer(self, transport: str):
        with self._lock:
            if transport not in self._dialers:
                self._dialers[transport] = transports.by_name(transport).load().Dialer(self.rank, self.ranks,
                                                                                       self.links)
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


def _spec_key(request_id: str) -> str:
    return f"push/{request_id}"


def _result_key(request_id: str, rank: int) -> str:
    return f"push-result/{request_id}/{rank}"


def publish(store, request_id: str, spec: PushSpec) -> None:
    store.set(_spec_key(request_id), pickle.dumps(spec))


def collect(store, request_id: str, ranks: range, timeout_s: float) -> TransferStats:
    """The followers' pushes of one request, summed; raises TransferError naming the first that failed."""
    keys = [_result_key(request_id, r) for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # torch raises DistStoreError (a RuntimeError) on timeout
        raise TransferError(f"prefill ranks {list(ranks)} did not report their KV push within {timeout_s} s") from None
    results = [json.loads(store.get(k)) for k in keys]
    for rank, r in zip(ranks, results):
        if "error" in r:
            raise TransferError(f"prefill rank {rank}: {r['error']}")
    return TransferStats(sum(r["bytes"] for r in results), sum(r["pieces"] for r in results),
                         max((r["seconds"] for r in results), default=0.0))


def forget(store, request_id: str, ranks: range) -> None:
    for key in [_spec_key(request_id)] + [_result_key(request_id, r) for r in ranks]:
        store.delete_key(key)


def push_kv(rank: int, store, runner, host: str, *, trace_spec: str = "none"):
    """The `follower_hook` of EngineCore: push this rank's share of every pushed prompt from its `host`;
    returns the before-step hook. Bind `trace_spec` with functools.partial."""
    setup_tracing(trace_spec, "prefill")
    links = DecodeLinks(rank, runner.cp_size, host)  # the prefill instance's ranks are its CP ranks
    last_layer = len(runner.kv_cache) - 1

    def before_step(plan):
        if not plan.pushes:
            return None
        pushes = []
        for index, request_id in plan.pushes:
            spec: PushSpec = pickle.loads(store.get(_spec_key(request_id)))
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


def _report(store, request_id: str, rank: int, sink: PlanSink, timeout_s: float, span: trace.Span) -> None:
    try:
        stats = sink.finish(timeout_s)
        result = {"bytes": stats.bytes, "pieces": stats.pieces, "seconds": stats.seconds}
    except Exception as e:  # noqa: BLE001 - every failure is reported to rank 0, which decides
        result = {"error": str(e)}
    store.set(_result_key(request_id, rank), json.dumps(result))
    span.set_attributes({"bytes": result.get("bytes", 0), "ok": "error" not in result,
                         "error": result.get("error", "")})
    span.end()
