"""The gRPC shell of a prefill instance: Prefill (prompt in, KV pushed to the decode target layer by
layer, first token out) and Cancel; the shared lifecycle, Admin, health and registry record of
`mesh.instance`.

    python -m prefill_svc.server --port 0 --model smollm2-135m [--registry ...] [--trace ...]

A failed KV transfer is not an error of the call: the response says KV_STATUS_FAILED with the reason
and decode recomputes. Failures are typed and mapped at the gRPC edge: bad sampling, prompt or target
-> INVALID_ARGUMENT; a transport no entry implements -> FAILED_PRECONDITION; cancelled -> CANCELLED;
draining or a failed engine -> UNAVAILABLE (and the instance reports itself DRAINING).
"""

from __future__ import annotations

import threading
import time

from engine import cpu_lending
from engine.core import EngineConfig, EngineCore
from engine.errors import RequestError
from engine.limits import DEFAULT_MAX_TOKENS
from engine.parallel.context import ExpertAttachment, ParallelConfig
from engine.parallel.control import Call
from engine.parallel.cp_choice import CPMethod
from engine.parallel.launcher import Rendezvous
from engine.sampling_params import SamplingParams
from engine.threads import off_the_engine_thread, pin_cpus
from engine.weights import load_checkpoint
from kvtransfer import kv_pool, transports
from kvtransfer.plan import DecodeLayout
from kvtransfer.shm_arena import shared_zeros
from mesh import rpc
from mesh.instance import Instance
from mesh.metrics import ENGINE_LOAD
from mesh.registry import Registry, Role
from mesh.service import serve
from mesh.settings import PrefillSettings
from mesh.telemetry import server_span, tracer
from prefill_svc.core import PrefillCore
from prefill_svc.push import push_kv
from protos.convert import logprobs_message, sampling_kwargs
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc

CP_METHODS = {CPMethod.PASS_KV: internal_pb2.CP_METHOD_PASS_KV, CPMethod.PASS_Q: internal_pb2.CP_METHOD_PASS_Q}


class PrefillService(internal_pb2_grpc.PrefillServicer):
    def __init__(self, instance: "PrefillInstance") -> None:
        self.instance, self.core, self.cp = instance, instance.core, instance.settings.cp

    def Prefill(self, request, context):
        rid = request.request_id
        with server_span(context, "prefill.run", request_id=rid, tokens=len(request.prompt_token_ids),
                         cp_size=self.cp) as span:
            self.instance.admit()
            target = request.target
            transport = transports.by_wire(target.transport)
            params = SamplingParams(**sampling_kwargs(request.sampling, DEFAULT_MAX_TOKENS))
            try:
                layout = DecodeLayout(head_ranges=tuple((h.start, h.end) for h in target.head_ranges),
                                      block_size=target.block_size, block_table=tuple(target.block_table),
                                      first_token=target.first_token)
            except ValueError as e:
                raise RequestError(f"target: {e}") from None
            if len(target.addresses) != len(layout.head_ranges):
                raise RequestError(f"target has {len(target.addresses)} addresses for {len(layout.head_ranges)} ranks")
            done = threading.Event()
            context.add_callback(lambda: done.is_set() or self.core.cancel(rid))  # the caller gave up
            result = self.core.prefill(rid, list(request.prompt_token_ids), params, layout, list(target.addresses),
                                       transport.name)
            done.set()
            stats, choice = result.transfer, result.cp_choice
            method = CP_METHODS[choice.method] if choice else internal_pb2.CP_METHOD_UNSPECIFIED
            reason = choice.reason if choice else f"cp={self.cp}: one rank" if self.cp == 1 else "a one-token prompt"
            _record_transfer_span(result, len(target.addresses), self.cp, transport.name)
            self.instance.record_metrics(result, transport.name, method)
            span.set_attributes({"cached_tokens": result.cached_tokens, "kv_bytes": stats.bytes if stats else 0,
                                 "cp_method": internal_pb2.CPMethod.Name(method), "cp_reason": reason,
                                 "kv_ok": result.kv_ok})
            return internal_pb2.PrefillResponse(
                first_token_id=result.first_token,
                first_logprobs=logprobs_message(result.logprobs) if result.logprobs else None,
                cp_method=method, cp_reason=reason,
                cached_tokens=result.cached_tokens,
                kv_status=internal_pb2.KV_STATUS_READY if result.kv_ok else internal_pb2.KV_STATUS_FAILED,
                kv_bytes=stats.bytes if stats else 0, kv_seconds=stats.seconds if stats else 0.0,
                prefill_seconds=result.prefill_seconds)

    def Cancel(self, request, context):
        return internal_pb2.CancelResponse(found=self.core.cancel(request.request_id))


def _record_transfer_span(result, ranks: int, source_ranks: int, transport: str) -> None:
    """A `kvtransfer.push` child span covering the push of every rank (measured by the sinks; ended when all
    were acknowledged); ranks 1.. of a CP instance add their own `kvtransfer.push.rank` spans."""
    stats = result.transfer
    end = time.time_ns()
    span = tracer().start_span("kvtransfer.push", start_time=end - int((stats.seconds if stats else 0) * 1e9),
                               attributes={"transport": transport, "destination_ranks": ranks,
                                           "source_ranks": source_ranks,
                                           "bytes": stats.bytes if stats else 0, "ok": result.kv_ok,
                                           "gb_per_s": round(stats.gb_per_s, 3) if stats else 0.0,
                                           "error": result.kv_error})
    span.end(end_time=end)


class PrefillInstance(Instance):
    """A prefill instance: CP ranks with an engine thread, KV pushes from every rank, the gRPC shell."""

    role = Role.PREFILL
    rpc_thread_init = staticmethod(off_the_engine_thread)

    def __init__(self, settings: PrefillSettings, instance_id: str | None = None,
                 registry: Registry | None = None) -> None:
        super().__init__(settings, instance_id, registry)
        s = settings
        config = EngineConfig.from_settings(s)
        experts = ExpertAttachment(**rpc.attach_to_experts(s.experts, self.id, s.cp, s.model),
                                   timeout_s=s.expert_timeout_s) if s.experts else None  # MoE experts run there
        options = transports.KVOptions.of(s)
        followers = Call.of(push_kv, trace_spec=s.trace, options=options) if s.cp > 1 else None
        checkpoint = load_checkpoint(s.model, config.torch_dtype)
        pool = kv_pool.attach(s.kv_pool_master, checkpoint, config, s.host, s.kv_pool_timeout_s)
        engine = EngineCore(checkpoint, config,
                            ParallelConfig(cp=s.cp, cp_method=s.cp_method, experts=experts), follower_hook=followers,
                            rendezvous=Rendezvous.of(s), kv_memory=shared_zeros if s.shared_kv_cache else None,
                            kv_pool=pool)
        self.core = PrefillCore(engine, host=s.host, on_failure=lambda _: self.fail(),
                                cpus=cpu_lending.from_flags(s.cpus), options=options).start()
        m = self.metrics
        m.gauges(engine.load, ENGINE_LOAD)
        self.count_engine(engine)
        self.prefix_cache_hits = m.counter("infermesh_prefix_cache_hits", "{token}",
                                           "Prompt tokens whose KV the prefix cache already held")
        by_transport = tuple({"transport": name} for name in transports.NAMES)
        self.kv_bytes = m.counter("infermesh_kv_transfer_bytes", "By", "KV bytes pushed to decode, by transport",
                                  zeros=by_transport)
        self.kv_seconds = m.seconds("infermesh_kv_transfer_seconds", "Time to push one prompt's KV, by transport")
        self.kv_failures = m.counter("infermesh_kv_transfer_failures", "{transfer}",
                                     "KV pushes that failed (decode recomputed the prompt), by transport",
                                     zeros=by_transport)
        self.cp_methods = m.counter("infermesh_cp_method", "{prompt}",
                                    "Prompts prefilled by each context-parallel method (pass_kv, pass_q, one_rank)")
        self.serve([(internal_pb2_grpc.add_PrefillServicer_to_server, PrefillService(self), "infermesh.v1.Prefill")])

    def record_metrics(self, result, transport: str, method: int) -> None:
        labels = {"transport": transport}
        self.prefix_cache_hits.add(result.cached_tokens)
        if result.transfer is not None:
            self.kv_bytes.add(result.transfer.bytes, labels)
            self.kv_seconds.record(result.transfer.seconds, labels)
        if not result.kv_ok:
            self.kv_failures.add(1, labels)
        name = internal_pb2.CPMethod.Name(method).removeprefix("CP_METHOD_").lower()
        self.cp_methods.add(1, {"method": "one_rank" if name == "unspecified" else name})

    def describe(self) -> dict:
        s = self.settings
        return {"parallel": {"tp": 1, "cp": s.cp, "ep": 1}, "block_size": s.block_size, **self.core.status()}

    def run(self, until: threading.Event) -> None:
        self.core.run_engine_here()  # until the engine stops or fails; then serve on until told
        until.wait()

    def in_flight(self) -> int:
        return self.core.in_flight

    def close(self) -> None:
        self.core.stop()


def main(argv: list[str] | None = None) -> None:
    serve("prefill", PrefillSettings, PrefillInstance, argv, pin=pin_cpus)


if __name__ == "__main__":
    main()
