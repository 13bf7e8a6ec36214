"""The router: the public `infermesh.v1.Inference` API. Tokenizes, routes, and streams tokens back.

For each request: pick a decode instance and decide where to prefill (router.policy);
disaggregated, it calls Reserve on decode, Prefill on the prefill instance (which
pushes the KV to decode), then Decode; otherwise Decode with prefill_locally.
Every hop gets the caller's deadline and the W3C trace context; when the client
cancels or its deadline passes, the downstream stream is cancelled and the decode
instance frees the request's blocks. Prompts are hashed for prefix hits in the KV
block size the decode instances publish. The router loads no torch: it needs the
tokenizer, sampling checks, model info and prefix hashes, all plain Python.

    python -m router.server --port 8000 --model smollm2-135m --registry redis://127.0.0.1:6379
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid

import grpc

from engine.block_manager import prefix_hashes
from engine.errors import RequestError
from engine.model_info import load_model_info
from engine.sampling_params import SamplingParams
from kvtransfer import transports
from mesh import rpc
from mesh.errors import from_status
from mesh.instance import Instance
from mesh.registry import Registry, Role
from mesh.service import serve
from mesh.settings import RouterSettings
from mesh.telemetry import outgoing_metadata, server_span, tracer
from protos.convert import sampling_kwargs
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from router.policy import NoInstance, route


class RouterService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, instance: "RouterInstance") -> None:
        self.instance, self.settings, self.registry = instance, instance.settings, instance.registry
        self.config, self.tokenizer = load_model_info(self.settings.model)
        self.kv_transport = transports.by_name(self.settings.kv_transport).wire
        self.channels = rpc.ChannelPool()
        self._turns = itertools.count()
        self._lock = threading.Lock()
        self.active = 0  # streams being served

    def ListModels(self, request, context):
        cfg = self.config
        return inference_pb2.ListModelsResponse(models=[inference_pb2.ModelCard(
            id=self.settings.model, architecture=cfg.architecture, max_model_len=cfg.max_model_len,
            vocab_size=cfg.vocab_size)])

    def Generate(self, request, context):
        self.instance.admit()
        if request.HasField("token_ids"):
            ids = list(request.token_ids.ids)
        elif request.text:
            ids = self.tokenizer.encode(request.text)
        else:
            raise RequestError("prompt: give text or token_ids (neither was set)")
        yield from self._serve(ids, request.sampling, request.request_id, context)

    def Chat(self, request, context):
        self.instance.admit()
        if not request.messages:
            raise RequestError("messages must not be empty")
        try:
            ids = self.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in request.messages])
        except ValueError as e:
            raise RequestError(f"messages: {e}") from None
        yield from self._serve(ids, request.sampling, request.request_id, context)

    def _serve(self, ids: list[int], sampling, request_id: str, context):
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        started = time.monotonic()
        try:
            SamplingParams(**sampling_kwargs(sampling))  # refuse bad parameters before any instance sees them
        except RequestError as e:
            raise RequestError(f"sampling: {e}") from None
        if not ids:
            raise RequestError("prompt must not be empty")
        with self._lock:
            self.active += 1
        try:
            yield from self._stream(rid, ids, sampling, context, started)
        finally:
            with self._lock:
                self.active -= 1

    def _stream(self, rid: str, ids: list[int], sampling, context, started: float):
        with server_span(context, "router.generate", request_id=rid, prompt_tokens=len(ids)) as span:
            failed: set[str] = set()  # decode instances that were unreachable for this request
            while True:
                chosen = self._route(ids, failed)
                streamed = False
                try:
                    for response in self._attempt(rid, ids, sampling, chosen, context, started):
                        streamed = True
                        if response.HasField("final"):
                            span.set_attribute("completion_tokens", response.final.usage.completion_tokens)
                        yield response
                    return
                except grpc.RpcError as e:
                    if e.code() is grpc.StatusCode.UNAVAILABLE and not streamed and context.is_active():
                        failed.add(chosen.decode.id)  # gone before its first token: try another instance
                        span.add_event("retry", {"unavailable": chosen.decode.id})
                        continue
                    raise from_status(e.code(), f"{chosen.decode.id}: {e.details()}") from None

    def _route(self, ids: list[int], failed: set[str]):
        with tracer().start_as_current_span("router.route") as route_span:
            decodes = [d for d in self.registry.instances(Role.DECODE) if d.id not in failed]
            block_size = next((d.block_size for d in decodes if d.block_size), 0)  # one for all: decode enforces it
            hits = self.registry.prefix_hits(prefix_hashes(ids, block_size)) if block_size else {}
            try:
                chosen = route(prompt_tokens=len(ids), decodes=decodes, prefills=self.registry.instances(Role.PREFILL),
                               policy=self.settings.policy, turn=next(self._turns), prefix_hits=hits,
                               block_size=block_size, local_prefill_max_tokens=self.settings.local_prefill_max_tokens)
            except NoInstance as e:
                raise NoInstance(str(e) + (f" (unreachable: {', '.join(sorted(failed))})" if failed else "")) from None
            route_span.set_attributes({"decode": chosen.decode.id, "reason": chosen.reason,
                                       "prefill": chosen.prefill.id if chosen.prefill else ""})
        return chosen

    def _attempt(self, rid: str, ids: list[int], sampling, chosen, context, started: float):
        """One try on the chosen instances: the responses to forward, the final one completed with timings."""
        metadata = outgoing_metadata()
        decode = internal_pb2_grpc.DecodeStub(self.channels.get(chosen.decode.address))
        if chosen.prefill is None:
            request = internal_pb2.DecodeRequest(request_id=rid, prefill_locally=True, prompt_token_ids=ids,
                                                 sampling=sampling)
        else:
            request = self._disaggregate(rid, ids, sampling, chosen, decode, metadata, self._remaining(context))
        responses = decode.Decode(request, timeout=self._remaining(context), metadata=metadata)
        context.add_callback(responses.cancel)  # the client left: stop the work downstream
        first_at = None
        for response in responses:
            if response.HasField("delta"):
                first_at = first_at or time.monotonic()
            else:
                final, end = response.final, time.monotonic()
                final.request_id = rid
                final.prompt_token_ids[:] = ids
                tokens = final.usage.completion_tokens
                final.timings.CopyFrom(common_pb2.Timings(
                    ttft_s=(first_at or end) - started, total_s=end - started,
                    tokens_per_s=(tokens - 1) / (end - first_at)
                    if first_at and end > first_at and tokens > 1 else 0.0))
            yield response

    def _disaggregate(self, rid, ids, sampling, chosen, decode, metadata, timeout) -> internal_pb2.DecodeRequest:
        target = decode.Reserve(internal_pb2.ReserveRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                                                            transport=self.kv_transport),
                                timeout=timeout, metadata=metadata).target
        try:
            prefill = internal_pb2_grpc.PrefillStub(self.channels.get(chosen.prefill.address))
            done = prefill.Prefill(internal_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                                                               target=target), timeout=timeout, metadata=metadata)
        except grpc.RpcError:  # the prefill instance failed: decode recomputes the prompt in its reservation
            return internal_pb2.DecodeRequest(request_id=rid, kv_status=internal_pb2.KV_STATUS_FAILED)
        return internal_pb2.DecodeRequest(request_id=rid, first_token_id=done.first_token_id, kv_status=done.kv_status)

    def _remaining(self, context) -> float:
        remaining = context.time_remaining()
        limit = self.settings.request_timeout_s
        return min(remaining, limit) if remaining is not None else limit


class RouterInstance(Instance):
    """A router: the public Inference service and the shared gRPC shell; its in-flight work is its streams."""

    role = Role.ROUTER

    def __init__(self, settings: RouterSettings, registry: Registry | None = None) -> None:
        super().__init__(settings, registry=registry)
        self.service = RouterService(self)
        self.serve([(inference_pb2_grpc.add_InferenceServicer_to_server, self.service, "infermesh.v1.Inference")])

    def in_flight(self) -> int:
        return self.service.active

    def close(self) -> None:
        self.service.channels.close()


def main(argv: list[str] | None = None) -> None:
    serve("router", RouterSettings, RouterInstance, argv)


if __name__ == "__main__":
    main()
