"""The gRPC shell of a prefill instance: Prefill (prompt in, KV pushed to the decode target layer by
layer, first token out), Cancel, Admin status, health and reflection; registered with a heartbeat.

    python -m prefill_svc.server --port 0 --model smollm2-135m [--registry ...] [--trace ...]

A failed KV transfer is not an error of the call: the response says KV_STATUS_FAILED with the reason
and decode recomputes. Bad sampling or prompt -> INVALID_ARGUMENT; an unsupported transport ->
FAILED_PRECONDITION; cancelled -> CANCELLED.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
import uuid

import grpc

from engine.core import EngineConfig, EngineCore, RequestError
from engine.parallel.context import ExpertAttachment, ParallelConfig
from engine.parallel.cp_choice import CPMethod
from engine.sampler import SamplingParams
from engine.weights import load_checkpoint
from kvtransfer.plan import DecodeLayout
from mesh import rpc
from mesh.registry import InstanceInfo, InstanceState, Registry, Role, connect_registry
from mesh.service import Heartbeat, serve
from mesh.settings import PrefillSettings
from mesh.telemetry import server_span, tracer
from prefill_svc.core import PrefillCore
from prefill_svc.push import GRPC_STREAM, TORCH_P2P, push_kv
from protos.convert import logprobs_message, sampling_kwargs
from protos.infermesh.v1 import common_pb2, internal_pb2, internal_pb2_grpc


TRANSPORTS = {internal_pb2.KV_TRANSPORT_GRPC_STREAM: GRPC_STREAM, internal_pb2.KV_TRANSPORT_TORCH_P2P: TORCH_P2P}
CP_METHODS = {CPMethod.PASS_KV: internal_pb2.CP_METHOD_PASS_KV, CPMethod.PASS_Q: internal_pb2.CP_METHOD_PASS_Q}


class PrefillService(internal_pb2_grpc.PrefillServicer):
    def __init__(self, core: PrefillCore, cp: int) -> None:
        self.core, self.cp = core, cp

    def Prefill(self, request, context):
        rid = request.request_id
        with server_span(context, "prefill.run", request_id=rid, tokens=len(request.prompt_token_ids),
                         cp_size=self.cp) as span:
            target = request.target
            transport = TRANSPORTS.get(target.transport)
            if transport is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "target.transport must be KV_TRANSPORT_GRPC_STREAM "
                              f"or KV_TRANSPORT_TORCH_P2P, got {internal_pb2.KVTransport.Name(target.transport)}")
            try:
                params = SamplingParams(**sampling_kwargs(request.sampling))
                layout = DecodeLayout(head_ranges=tuple((h.start, h.end) for h in target.head_ranges),
                                      block_size=target.block_size, block_table=tuple(target.block_table),
                                      first_token=target.first_token)
                if len(target.addresses) != len(layout.head_ranges):
                    raise ValueError(f"target has {len(target.addresses)} addresses for {len(layout.head_ranges)} ranks")
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            done = threading.Event()
            context.add_callback(lambda: done.is_set() or self.core.cancel(rid))  # the caller gave up
            try:
                result = self.core.prefill(rid, list(request.prompt_token_ids), params, layout, list(target.addresses),
                                           transport)
                done.set()
            except RequestError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeError as e:
                context.abort(grpc.StatusCode.CANCELLED if "cancelled" in str(e) else grpc.StatusCode.UNAVAILABLE, str(e))
            stats, choice = result.transfer, result.cp_choice
            method = CP_METHODS[choice.method] if choice else internal_pb2.CP_METHOD_UNSPECIFIED
            reason = choice.reason if choice else f"cp={self.cp}: one rank" if self.cp == 1 else "a one-token prompt"
            _record_transfer_span(result, len(target.addresses), self.cp, transport)
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


class AdminService(internal_pb2_grpc.AdminServicer):
    def __init__(self, record) -> None:
        self.record = record

    def Status(self, request, context):
        info = self.record()
        return internal_pb2.InstanceStatus(
            id=info.id, role=common_pb2.ROLE_PREFILL, address=info.address, pid=info.pid, model=info.model,
            parallel=common_pb2.ParallelLayout(**info.parallel), state=common_pb2.INSTANCE_STATE_SERVING,
            active_requests=info.active_requests, total_requests=info.total_requests,
            kv_blocks_used=info.kv_blocks_used, kv_blocks_total=info.kv_blocks_total)


class PrefillInstance:
    """A running prefill instance: engine thread, gRPC server, registry heartbeat. `stop()` is safe twice."""

    def __init__(self, settings: PrefillSettings, instance_id: str | None = None, registry: Registry | None = None) -> None:
        self.settings = s = settings
        self.id = instance_id or f"prefill-{uuid.uuid4().hex[:8]}"
        config = EngineConfig(dtype=s.dtype, block_size=s.block_size, kv_cache_bytes=s.kv_cache_bytes,
                              max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens)
        experts = ExpertAttachment(**rpc.attach_to_experts(s.experts, self.id, s.cp, s.model),
                                   timeout_s=s.expert_timeout_s) if s.experts else None  # MoE experts run there
        engine = EngineCore(load_checkpoint(s.model, config.torch_dtype), config,
                            ParallelConfig(cp=s.cp, cp_method=s.cp_method, experts=experts),
                            attach=functools.partial(push_kv, trace_spec=s.trace) if s.cp > 1 else None)
        self.core = PrefillCore(engine).start()
        self.server, port, self.health = rpc.start_server(s.host, s.port, [
            (internal_pb2_grpc.add_PrefillServicer_to_server, PrefillService(self.core, s.cp), "infermesh.v1.Prefill"),
            (internal_pb2_grpc.add_AdminServicer_to_server, AdminService(self._record), "infermesh.v1.Admin"),
        ])
        self.address = f"{s.host}:{port}"
        self.info = InstanceInfo(id=self.id, role=Role.PREFILL, address=self.address, pid=os.getpid(), model=s.model,
                                 parallel={"tp": 1, "cp": s.cp, "ep": 1}, state=InstanceState.SERVING)
        self.heartbeat = Heartbeat(registry or connect_registry(s.registry), self._record, s.heartbeat_s, s.ttl_s)
        self._stopped = False

    def _record(self) -> InstanceInfo:
        state = InstanceState.DRAINING if self.core.failed else InstanceState.SERVING
        return dataclasses.replace(self.info, state=state, **self.core.status())

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.heartbeat.stop()
        self.server.stop(grace=None)
        self.core.stop()


def main(argv: list[str] | None = None) -> None:
    serve("prefill", PrefillSettings, PrefillInstance, argv)


if __name__ == "__main__":
    main()
