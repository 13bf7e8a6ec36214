"""The gRPC shell of a decode instance: Decode (reserve, stream tokens, cancel), KVTransfer (receives
pushed KV into reserved blocks), Admin status, health and reflection; registered with a heartbeat.

    python -m decode_svc.server --port 0 --model smollm2-135m [--registry memory|redis://...] ...

Errors map to status codes: bad sampling or prompt -> INVALID_ARGUMENT (naming the field and limit),
no room in the KV cache -> RESOURCE_EXHAUSTED, unknown request -> NOT_FOUND, draining -> UNAVAILABLE.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import uuid

import grpc

from decode_svc.core import DecodeCore
from decode_svc.follower import accept_kv
from engine.core import EngineConfig, EngineCore, RequestError
from engine.parallel.context import ExpertAttachment, ParallelConfig
from engine.parallel.tp import head_shard
from engine.sampler import SamplingParams
from engine.weights import load_checkpoint
from kvtransfer.grpc_stream import DTYPES, KVTransferService
from kvtransfer.pairing import PairHost, PairListener
from kvtransfer.transport import KVReceiver
from mesh import rpc
from mesh.registry import InstanceInfo, InstanceState, Registry, Role, connect_registry
from mesh.service import Heartbeat, serve
from mesh.settings import DecodeSettings
from mesh.telemetry import server_span
from protos.convert import FINISH_REASONS, logprobs_message, sampling_kwargs
from protos.infermesh.v1 import common_pb2, inference_pb2, internal_pb2, internal_pb2_grpc

EVENT_TIMEOUT_S = 600.0  # the longest gap between two tokens of one request before the stream gives up


class DecodeService(internal_pb2_grpc.DecodeServicer):
    def __init__(self, core: DecodeCore, instance_id: str, address: str, rank_addresses: list[str],
                 pair_address: str) -> None:
        """`rank_addresses`: the KVTransfer servers of ranks 1..N-1 (rank 0's is this server, `address`);
        `pair_address`: the pairing store of the torch_p2p transport."""
        self.core, self.instance_id, self.address, self.rank_addresses = core, instance_id, address, rank_addresses
        self.pair_address = pair_address
        cache = core.engine.kv_cache[0][0]
        self.block_size, self.dtype = cache.shape[1], cache.dtype
        cfg, tp = core.engine.model_config, core.engine.parallel.tp
        self.head_ranges = [head_shard(cfg, tp, r).kv_heads for r in range(tp)]

    def Reserve(self, request, context):
        with server_span(context, "decode.reserve", request_id=request.request_id,
                         prompt_tokens=len(request.prompt_token_ids)):
            params = _sampling(request.sampling, context)
            transport = request.transport or internal_pb2.KV_TRANSPORT_GRPC_STREAM
            if transport == internal_pb2.KV_TRANSPORT_GRPC_STREAM:
                addresses = [self.address, *self.rank_addresses]
            elif transport == internal_pb2.KV_TRANSPORT_TORCH_P2P and self.pair_address:
                addresses = [self.pair_address] * (1 + len(self.rank_addresses))
            else:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "transport must be KV_TRANSPORT_GRPC_STREAM or "
                              "KV_TRANSPORT_TORCH_P2P (CPU caches only), got "
                              f"{internal_pb2.KVTransport.Name(transport)}")
            table, cached = _run(context, lambda: self.core.reserve(request.request_id, list(request.prompt_token_ids),
                                                                     params))
            return internal_pb2.ReserveResponse(target=internal_pb2.KVTarget(
                decode_id=self.instance_id, transport=transport, addresses=addresses,
                head_ranges=[internal_pb2.HeadRange(start=a, end=b) for a, b in self.head_ranges], block_size=self.block_size,
                block_table=list(table), first_token=cached, dtype=DTYPES[self.dtype]))

    def Decode(self, request, context):
        rid = request.request_id
        with server_span(context, "decode.request", request_id=rid, prefill_locally=request.prefill_locally) as span:
            if request.prefill_locally:
                params = _sampling(request.sampling, context)
                stream = _run(context, lambda: self.core.generate(rid, list(request.prompt_token_ids), params))
            else:
                ready = request.kv_status == internal_pb2.KV_STATUS_READY
                stream = _run(context, lambda: self.core.join(rid, request.first_token_id if ready else None))
            finished = threading.Event()
            context.add_callback(lambda: finished.is_set() or self.core.cancel(rid))  # client gone: free its blocks
            tokens = 0
            while True:
                try:
                    event = stream.get(timeout=EVENT_TIMEOUT_S)
                except queue.Empty:
                    self.core.cancel(rid)
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no token for {EVENT_TIMEOUT_S} s")
                if event.error:  # the instance failed, not the request: another instance may serve it
                    context.abort(grpc.StatusCode.UNAVAILABLE, event.error)
                tokens += len(event.token_ids)
                if event.token_ids or event.text:
                    yield inference_pb2.GenerateResponse(delta=inference_pb2.Delta(
                        token_ids=event.token_ids, text=event.text,
                        logprobs=[logprobs_message(lp) for lp in event.logprobs]))
                if event.finish_reason:
                    finished.set()
                    span.set_attribute("completion_tokens", tokens)
                    yield inference_pb2.GenerateResponse(final=inference_pb2.Final(
                        request_id=rid, finish_reason=FINISH_REASONS[event.finish_reason],
                        usage=common_pb2.Usage(**event.usage)))
                    return

    def Cancel(self, request, context):
        return internal_pb2.CancelResponse(found=self.core.cancel(request.request_id))


class AdminService(internal_pb2_grpc.AdminServicer):
    def __init__(self, core: DecodeCore, info: InstanceInfo) -> None:
        self.core, self.info = core, info

    def Status(self, request, context):
        return internal_pb2.InstanceStatus(
            id=self.info.id, role=common_pb2.ROLE_DECODE, address=self.info.address, pid=self.info.pid,
            model=self.info.model, parallel=common_pb2.ParallelLayout(**self.info.parallel),
            state=common_pb2.INSTANCE_STATE_DRAINING if self.core.draining or self.core.failed
            else common_pb2.INSTANCE_STATE_SERVING,
            **self.core.status())


def _sampling(message, context) -> SamplingParams:
    try:
        return SamplingParams(**sampling_kwargs(message))
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")


def _run(context, fn):
    try:
        return fn()
    except RequestError as e:
        message = str(e)
        if "free blocks" in message:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        if "no reservation" in message:
            context.abort(grpc.StatusCode.NOT_FOUND, message)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
    except RuntimeError as e:  # draining or stopped
        context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


class DecodeInstance:
    """A running decode instance: engine thread, gRPC server, registry heartbeat. `stop()` is safe twice."""

    def __init__(self, settings: DecodeSettings, instance_id: str | None = None, registry: Registry | None = None) -> None:
        self.settings = s = settings
        self.id = instance_id or f"decode-{uuid.uuid4().hex[:8]}"
        config = EngineConfig(dtype=s.dtype, block_size=s.block_size, kv_cache_bytes=s.kv_cache_bytes,
                              max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens)
        self.pairs = PairHost(s.host) if config.device == "cpu" else None  # torch_p2p runs over gloo
        pair_address = self.pairs.address if self.pairs else ""
        experts = ExpertAttachment(**rpc.attach_to_experts(s.experts, self.id, s.tp, s.model),
                                   timeout_s=s.expert_timeout_s) if s.experts else None  # MoE experts run there
        followers = functools.partial(accept_kv, pair_address=pair_address, ranks=s.tp) if s.tp > 1 else None
        engine = EngineCore(load_checkpoint(s.model, config.torch_dtype), config,
                            ParallelConfig(tp=s.tp, experts=experts), attach=followers)
        store = engine.executor.store if s.tp > 1 else None
        rank_addresses = [store.get(f"kv-address/{r}").decode() for r in range(1, s.tp)] if store else []
        self.core = DecodeCore(engine, shared_store=store).start()
        receiver = KVReceiver(engine.kv_cache, self.core.reservations.get, self.core.kv_lock)
        self.pair_listener = PairListener(pair_address, 0, s.tp, receiver) if self.pairs else None
        decode = DecodeService(self.core, self.id, address="", rank_addresses=rank_addresses, pair_address=pair_address)
        self.info = InstanceInfo(id=self.id, role=Role.DECODE, address="", pid=os.getpid(), model=s.model,
                                 parallel={"tp": s.tp, "cp": 1, "ep": 1}, state=InstanceState.SERVING)
        admin = AdminService(self.core, self.info)
        self.server, port, self.health = rpc.start_server(s.host, s.port, [
            (internal_pb2_grpc.add_DecodeServicer_to_server, decode, "infermesh.v1.Decode"),
            (internal_pb2_grpc.add_KVTransferServicer_to_server, KVTransferService(receiver), "infermesh.v1.KVTransfer"),
            (internal_pb2_grpc.add_AdminServicer_to_server, admin, "infermesh.v1.Admin"),
        ])
        self.address = decode.address = f"{s.host}:{port}"
        self.info = admin.info = dataclasses.replace(self.info, address=self.address)
        self.heartbeat = Heartbeat(registry or connect_registry(s.registry), self._record, s.heartbeat_s, s.ttl_s,
                                   block_hashes=self.core.cached_block_hashes)
        self._stopped = False

    def _record(self) -> InstanceInfo:
        state = InstanceState.DRAINING if self.core.draining or self.core.failed else InstanceState.SERVING
        return dataclasses.replace(self.info, state=state, **self.core.status())

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.heartbeat.stop()
        self.server.stop(grace=None)
        if self.pair_listener:
            self.pair_listener.stop()
        self.core.stop()  # stops the follower ranks and their listeners
        self.pairs = None  # closes the pairing store


def main(argv: list[str] | None = None) -> None:
    serve("decode", DecodeSettings, DecodeInstance, argv)


if __name__ == "__main__":
    main()
