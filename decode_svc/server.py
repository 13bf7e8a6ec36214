"""The gRPC shell of a decode instance: Decode (reserve, stream tokens, cancel) and, on every rank, an
endpoint of each KV transport it offers, which receives pushed KV into reserved blocks; the shared
lifecycle, Admin, health and registry record of `mesh.instance`.

    python -m decode_svc.server --port 0 --model smollm2-135m [--registry memory|redis://...] ...

Failures are typed (`engine.errors`) and mapped to status codes at the gRPC edge: bad sampling or
prompt -> INVALID_ARGUMENT (naming the field and limit), no room in the KV cache -> RESOURCE_EXHAUSTED,
unknown reservation -> NOT_FOUND, a transport it does not offer -> FAILED_PRECONDITION, draining or a
failed engine -> UNAVAILABLE. Every decode instance of a mesh uses one KV block size: one whose
setting differs from the registered instances' refuses to start.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import grpc
from opentelemetry import propagate, trace

from decode_svc.core import DecodeCore, TokenEvent
from decode_svc.follower import accept_kv, open_endpoints
from engine import cpu_lending
from engine.core import EngineConfig, EngineCore
from engine.errors import DeadlineExceeded, ServingError, Unsupported
from engine.limits import DEFAULT_MAX_TOKENS
from engine.parallel.context import ExpertAttachment, ParallelConfig
from engine.parallel.control import Call
from engine.parallel.launcher import Rendezvous
from engine.parallel.tp import head_shard
from engine.sampling_params import SamplingParams, TokenLogprobs
from engine.threads import off_the_engine_thread, pin_cpus
from engine.weights import load_checkpoint
from kvtransfer import kv_pool, transports
from kvtransfer.control import KV_ENDPOINT
from kvtransfer.grpc_stream import WIRE_DTYPES
from mesh import rpc
from mesh.errors import status_code
from mesh.instance import Instance
from mesh.metrics import ENGINE_LOAD
from mesh.registry import Registry, Role
from mesh.service import serve
from mesh.settings import DecodeSettings
from mesh.telemetry import recording, server_span, tracer
from protos.convert import FINISH_REASONS, logprobs_fields, logprobs_message, sampling_kwargs
from protos.infermesh.v1 import common_pb2, inference_pb2, internal_pb2, internal_pb2_grpc

EVENT_TIMEOUT_S = 600.0  # the longest gap between two tokens of one request before the stream gives up


class DecodeService(internal_pb2_grpc.DecodeServicer):
    def __init__(self, instance: "DecodeInstance") -> None:
        self.instance, self.core = instance, instance.core
        cache = self.core.engine.kv_cache[0][0]
        self.block_size, self.dtype = cache.shape[1], cache.dtype
        cfg, tp = self.core.engine.model_config, self.core.engine.parallel.tp
        self.head_ranges = [head_shard(cfg, tp, r).kv_heads for r in range(tp)]

    def Reserve(self, request, context):
        with server_span(context, "decode.reserve", request_id=request.request_id,
                         prompt_tokens=len(request.prompt_token_ids)):
            self.instance.admit()
            params = SamplingParams(**sampling_kwargs(request.sampling, DEFAULT_MAX_TOKENS))
            transport = transports.by_wire(request.transport or internal_pb2.KV_TRANSPORT_GRPC_STREAM)
            addresses = self.instance.kv_endpoints.get(transport.name)
            if addresses is None:
                raise Unsupported(f"transport {transport.name} needs {transport.needs(self.instance.device)}; this "
                                  f"instance offers {', '.join(self.instance.kv_endpoints)}")
            table, cached = self.core.reserve(request.request_id, list(request.prompt_token_ids), params)
            return internal_pb2.ReserveResponse(target=internal_pb2.KVTarget(
                decode_id=self.instance.id, transport=transport.wire, addresses=addresses,
                head_ranges=[internal_pb2.HeadRange(start=a, end=b) for a, b in self.head_ranges],
                block_size=self.block_size, block_table=list(table), first_token=cached, dtype=WIRE_DTYPES[self.dtype]))

    def _open(self, request, into: queue.Queue | None = None) -> Future:
        """Start a DecodeRequest here: a new request (admitted unless draining) or the join of a reservation
        (in-flight work, admitted even while draining); the future of its events' queue (see DecodeCore)."""
        if request.prefill_locally:
            self.instance.admit()
            params = SamplingParams(**sampling_kwargs(request.sampling, DEFAULT_MAX_TOKENS))
            return self.core.generate(request.request_id, list(request.prompt_token_ids), params,
                                      tuple(request.resume_token_ids), into=into)
        ready = request.kv_status == internal_pb2.KV_STATUS_READY
        logprobs = TokenLogprobs(*logprobs_fields(request.first_logprobs)) if request.HasField("first_logprobs") \
            else None
        return self.core.join(request.request_id, request.first_token_id if ready else None, logprobs, into=into)

    def _responses(self, rid: str, event: TokenEvent) -> list[inference_pb2.GenerateResponse]:
        """A request's event as it goes out: its delta, then its final response if it is the last."""
        out = []
        if event.token_ids or event.text:
            out.append(inference_pb2.GenerateResponse(delta=inference_pb2.Delta(
                token_ids=event.token_ids, text=event.text, logprobs=[logprobs_message(lp) for lp in event.logprobs])))
        if event.finish_reason:
            self.instance.prefix_cache_hits.add(event.usage["cached_prompt_tokens"])
            out.append(inference_pb2.GenerateResponse(final=inference_pb2.Final(
                request_id=rid, finish_reason=FINISH_REASONS[event.finish_reason],
                usage=common_pb2.Usage(**event.usage))))
        return out

    def Decode(self, request, context):
        rid = request.request_id
        with server_span(context, "decode.request", request_id=rid, prefill_locally=request.prefill_locally) as span:
            stream = self._open(request).result()
            finished = threading.Event()
            context.add_callback(lambda: finished.is_set() or self.core.cancel(rid))  # client gone: free its blocks
            tokens = 0
            while True:
                try:
                    event = stream.get(timeout=EVENT_TIMEOUT_S)
                except queue.Empty:
                    self.core.cancel(rid)
                    raise DeadlineExceeded(f"no token for {EVENT_TIMEOUT_S} s") from None
                if event.error:  # the instance failed, not the request: another instance may serve it
                    raise event.error
                tokens += len(event.token_ids)
                if event.finish_reason:
                    finished.set()
                    span.set_attribute("completion_tokens", tokens)
                yield from self._responses(rid, event)
                if event.finish_reason:
                    return

    def Stream(self, requests, context):
        """Requests multiplexed on one stream: a reader thread starts and cancels them as they come; here,
        whatever events are queued when this thread wakes (a step's tokens for every request come as one
        list) go out in one message. Each request's span runs from its start to its last event."""
        events: queue.Queue = queue.Queue()  # lists of (request_id, TokenEvent | its error); None: the end
        spans: dict[str, trace.Span] = {}  # the requests started here and not finished

        def start(item) -> None:
            request = item.decode
            rid = request.request_id
            spans[rid] = trace.INVALID_SPAN  # (a no-op span where this process records none)
            if recording():
                spans[rid] = tracer().start_span("decode.request", propagate.extract(dict(item.trace_context)),
                                                 kind=trace.SpanKind.SERVER, attributes={
                                                     "request_id": rid, "prefill_locally": request.prefill_locally})
            try:
                self._open(request, into=events).add_done_callback(
                    lambda done: done.exception() and events.put([(rid, done.exception())]))
            except ServingError as e:  # not admitted, or bad sampling parameters
                events.put([(rid, e)])

        def read() -> None:
            try:
                for item in requests:
                    if item.HasField("decode"):
                        start(item)
                    elif item.HasField("cancel"):
                        self.core.cancel(item.cancel.request_id)
            except (grpc.RpcError, ServingError):  # the router went away, or the engine stopped
                pass
            finally:
                events.put(None)

        threading.Thread(target=read, name="decode-stream-reader", daemon=True).start()
        try:
            while True:
                batch = [events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                out = [self._stream_event(rid, event, spans) for each in filter(None, batch) for rid, event in each]
                if out:
                    yield internal_pb2.StreamResponse(events=[e for each in out for e in each])
                if None in batch:
                    return
        finally:  # the stream closed: what it started and did not finish is cancelled, its blocks freed
            for rid, span in list(spans.items()):
                span.end()
                try:
                    self.core.cancel(rid)
                except ServingError:  # the engine stopped meanwhile: it freed everything itself
                    pass

    def _stream_event(self, rid: str, event, spans: dict) -> list[internal_pb2.StreamEvent]:
        span = spans.get(rid)
        error = event if isinstance(event, Exception) else event.error
        if error is not None or event.finish_reason:
            spans.pop(rid, None)
        if error is not None:
            if span is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
                span.end()
            code = status_code(error) if isinstance(error, ServingError) else grpc.StatusCode.INTERNAL
            return [internal_pb2.StreamEvent(request_id=rid, status_code=code.value[0], status_message=str(error))]
        if event.finish_reason and span is not None:
            span.set_attribute("completion_tokens", event.usage["completion_tokens"])
            span.end()
        return [internal_pb2.StreamEvent(request_id=rid, response=r) for r in self._responses(rid, event)]

    def Cancel(self, request, context):
        return internal_pb2.CancelResponse(found=self.core.cancel(request.request_id))


class DecodeInstance(Instance):
    """A decode instance: TP ranks with an engine thread, KV endpoints, the gRPC shell."""

    role = Role.DECODE
    rpc_thread_init = staticmethod(off_the_engine_thread)  # handlers writing pushed KV leave the engine its cores

    def __init__(self, settings: DecodeSettings, instance_id: str | None = None,
                 registry: Registry | None = None) -> None:
        super().__init__(settings, instance_id, registry)
        s = settings
        self._check_block_size()
        config = EngineConfig.from_settings(s)
        self.device, options = config.device, transports.KVOptions.of(s)
        offered = [t for t in transports.TRANSPORTS if t.usable(config.device)]
        self.shared = {t.name: t.load().shared(s.host) for t in offered}  # hosted here for every rank
        shared = {name: obj.address if obj else None for name, obj in self.shared.items()}
        experts = ExpertAttachment(**rpc.attach_to_experts(s.experts, self.id, s.tp, s.model),
                                   timeout_s=s.expert_timeout_s) if s.experts else None  # MoE experts run there
        followers = Call.of(accept_kv, ranks=s.tp, shared=shared, options=options) if s.tp > 1 else None
        checkpoint = load_checkpoint(s.model, config.torch_dtype)
        pool = kv_pool.attach(s.kv_pool_master, checkpoint, config, s.host, s.kv_pool_timeout_s)
        engine = EngineCore(checkpoint, config,
                            ParallelConfig(tp=s.tp, experts=experts), follower_hook=followers,
                            rendezvous=Rendezvous.of(s), kv_pool=pool)
        store = engine.executor.store if s.tp > 1 else None
        self.core = DecodeCore(engine, shared_store=store, on_failure=lambda _: self.fail(),
                               lease_s=s.reservation_lease_s,
                               cpus=cpu_lending.from_flags(s.cpus, s.borrow_cpus)).start()
        self.metrics.gauges(engine.load, ENGINE_LOAD)
        self.count_engine(engine)
        self.metrics.counted("infermesh_kv_recomputed_requests", "{request}",
                             "Reserved requests prefilled here after all: their KV transfer failed or came late",
                             lambda: engine.recomputed_requests)
        self.metrics.counted("infermesh_engine_steps_on_borrowed_cores", "{step}",
                             "Engine steps run on the cores of idle instances of this host as well (up --cpus split)",
                             lambda: self.core.borrowed_steps)
        self.prefix_cache_hits = self.metrics.counter("infermesh_prefix_cache_hits", "{token}",
                                                      "Prompt tokens whose KV the prefix cache already held")
        self.links = rpc.Links(s.host, thread_init=off_the_engine_thread, options=options)
        self.endpoints = open_endpoints(0, s.tp, self.core.receiver, self.links, shared)
        self.kv_endpoints = {name: [e.address, *(store.get(KV_ENDPOINT.key(name, r)).address for r in range(1, s.tp))]
                             for name, e in self.endpoints.items()}  # per transport: every rank's endpoint
        self.serve([(internal_pb2_grpc.add_DecodeServicer_to_server, DecodeService(self), "infermesh.v1.Decode")],
                   block_hashes=self.core.cached_block_hashes)

    def _check_block_size(self) -> None:
        try:
            others = {d.block_size for d in self.registry.instances(Role.DECODE) if d.block_size}
        except Exception:  # the registry is unreachable now: nothing to compare with (the heartbeat retries)
            return
        if others - {self.settings.block_size}:
            raise ValueError(f"block_size={self.settings.block_size} differs from the registered decode instances' "
                             f"({', '.join(map(str, sorted(others)))}): every decode instance of a mesh uses one")

    def describe(self) -> dict:
        s = self.settings
        return {"parallel": {"tp": s.tp, "cp": 1, "ep": 1}, "block_size": s.block_size, **self.core.status()}

    def run(self, until: threading.Event) -> None:
        self.core.run_engine_here()  # until the engine stops or fails; then serve on until told
        until.wait()

    def in_flight(self) -> int:
        return self.core.in_flight

    def close(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.stop()
        self.core.stop()  # stops the follower ranks and their endpoints
        self.links.close()
        for shared in self.shared.values():
            if shared is not None:
                shared.close()


def main(argv: list[str] | None = None) -> None:
    serve("decode", DecodeSettings, DecodeInstance, argv, pin=pin_cpus)


if __name__ == "__main__":
    main()
