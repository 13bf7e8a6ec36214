"""The one path every face of the router calls (the gRPC `Inference` service and the OpenAI-compatible
HTTP front): checks, prompts, routing, and the stream of `GenerateResponse`s with retries.

For each request: pick a decode instance and decide where to prefill (router.policy);
disaggregated, it calls Reserve on decode, Prefill on the prefill instance (which
pushes the KV to decode), then joins the request on decode; otherwise it sends the
request with prefill_locally. Requests reach a decode instance on one stream shared
by all of them (router.decode_streams).
Every hop gets the caller's deadline and the W3C trace context; when the client
leaves or its deadline passes, the downstream stream is cancelled and the decode
instance frees the request's blocks. Prompts are hashed for prefix hits in the KV
block size the decode instances publish. The registry's load of an instance lags
a heartbeat; the router adds what it has routed there itself and not yet seen
finish (requests, prompt blocks), so a burst spreads and a full mesh sheds
(RESOURCE_EXHAUSTED) instead of queueing without bound.

`stream` is an async generator, run on the router's event loop (`mesh.loop`) with every
client it calls (grpc.aio): a token crosses the router with no thread wake. A face hands
it a `call`: gRPC's servicer context, or any object with its two methods
`time_remaining()` and `invocation_metadata()` (the caller's trace context); a client
that leaves cancels the task iterating it, and the work downstream with it.
Failures are typed (`engine.errors`); each face maps them. Plain Python: no torch in
the router process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import AsyncIterator, Callable

import grpc
from opentelemetry import trace

from engine.block_manager import prefix_hashes
from engine.errors import DeadlineExceeded, RequestError, ServingError, UnknownModel
from engine.limits import DEFAULT_MAX_TOKENS
from engine.model_info import load_model_info
from engine.sampling_params import SamplingParams
from kvtransfer import transports
from mesh import auth, rpc
from mesh.errors import from_status, status_code
from mesh.metrics import Metrics
from mesh.registry import Role
from mesh.registry.snapshot import Snapshot
from mesh.settings import RouterSettings
from mesh.telemetry import child_span, outgoing_metadata, server_span
from protos.convert import sampling_kwargs
from protos.infermesh.v1 import common_pb2, inference_pb2, internal_pb2, internal_pb2_grpc
from router.decode_streams import DecodeStreams
from router.limits import fit
from router.policy import Decision, NoInstance, route

CHAT_ROLES = ("system", "user", "assistant")
CANCEL_TIMEOUT_S = 2.0  # for freeing a failed request's reservation on decode


class RouterCore:
    def __init__(self, settings: RouterSettings, registry: Snapshot, admit: Callable[[], None],
                 metrics: Metrics) -> None:
        """`admit()`: the instance's gate for new work (raises `Draining` unless it serves)."""
        self.settings, self.registry, self._admit = settings, registry, admit
        self.requests = metrics.counter("infermesh_requests", "{request}",
                                        "Requests served, by outcome: ok, or the failure's gRPC status code",
                                        zeros=({"outcome": "ok"},))
        self.ttft = metrics.seconds("infermesh_time_to_first_token", "Time to the first token, per request")
        self.tpot = metrics.seconds("infermesh_time_per_output_token", "Time per token after the first, per request")
        self.prompt_tokens = metrics.tokens("infermesh_request_prompt_tokens", "Prompt tokens per request")
        self.generation_tokens = metrics.tokens("infermesh_request_generation_tokens", "Generated tokens per request")
        self.routes = metrics.counter("infermesh_routing_decisions", "{request}",
                                      "Where prompts were prefilled (disaggregated, or locally and why)",
                                      zeros=tuple({"decision": d.value} for d in Decision))
        self.retries = metrics.counter("infermesh_retries", "{retry}",
                                       "Requests tried again on another decode instance (failed before a token)")
        self.migrations = metrics.counter("infermesh_migrations", "{migration}",
                                          "Streams resumed on another decode instance after theirs died mid-stream")
        self.config, self.tokenizer = load_model_info(settings.model)
        self.kv_transport = transports.by_name(settings.kv_transport).wire
        self.channels = rpc.ChannelPool(rpc.aio_channel)  # grpc.aio: used on the router's event loop only
        self.decode_streams = DecodeStreams(self.channels)  # every request to a decode instance goes on its stream
        self._turns = itertools.count()
        self.active = 0  # streams being served (the loop changes it; any thread may read it)
        self._routed: dict[str, list[int]] = {}  # decode id -> [requests, prompt blocks] routed, unfinished
        self._block_size = 0  # the decode instances' KV block size, as last read
        self._cancels: set[asyncio.Task] = set()  # reservations being freed after their request failed

    # ---- checks and prompts (both faces) ---------------------------------------------------

    def admit(self, authorization: str | None, model: str = "") -> None:
        """A new request: the instance serves, the caller's `Bearer` token is right (when one is set) and
        it asks for the model served here ("" means that one)."""
        self._admit()
        auth.require(self.settings.api_token, authorization, "the API")
        if model and model != self.settings.model:
            raise UnknownModel(f"model {model!r} is not served here; served: {self.settings.model!r}", param="model")

    def prompt_ids(self, text: str | None = None, ids: list[int] | None = None) -> list[int]:
        if ids is not None:
            return list(ids)
        if not text:
            raise RequestError("prompt: give text or token ids (neither was set)", param="prompt")
        return self.tokenizer.encode(text)

    def chat_ids(self, messages: list[tuple[str, str]]) -> list[int]:
        """(role, content) pairs through the model's chat template."""
        if not messages:
            raise RequestError("messages must not be empty", param="messages")
        for i, (role, _) in enumerate(messages):
            if role not in CHAT_ROLES:
                raise RequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                   param="messages")
        try:
            return self.tokenizer.encode_chat([{"role": role, "content": content} for role, content in messages])
        except ValueError as e:
            raise RequestError(f"messages: {e}", param="messages") from None

    def model_card(self) -> inference_pb2.ModelCard:
        cfg = self.config
        return inference_pb2.ModelCard(id=self.settings.model, architecture=cfg.architecture,
                                       max_model_len=cfg.max_model_len, vocab_size=cfg.vocab_size)

    # ---- the stream ------------------------------------------------------------------------

    async def stream(self, ids: list[int], sampling: common_pb2.SamplingParams, request_id: str, call,
                     default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                     ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Deltas, then one final response (with the prompt's ids and timings), of one admitted request.
        `default_max_tokens`: what an unset `max_tokens` means on the calling face (`engine.limits`)."""
        started = time.monotonic()
        self.active += 1
        outcome = "ok"
        try:
            try:
                SamplingParams(**sampling_kwargs(sampling, DEFAULT_MAX_TOKENS))  # bad ones: refused before any instance
            except RequestError as e:
                raise RequestError(f"sampling: {e}", param=e.param) from None
            sampling = fit(ids, sampling, self.config.vocab_size, self.config.max_model_len, default_max_tokens)
            async for response in self._stream(request_id, ids, sampling, call, started):
                if response.HasField("final"):
                    self._record(response.final)
                yield response
        except ServingError as e:
            outcome = status_code(e).name.lower()
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client left (or the face stopped reading)
            outcome = "cancelled"
            raise
        finally:
            self.requests.add(1, {"outcome": outcome})
            self.active -= 1

    def _record(self, final: inference_pb2.Final) -> None:
        tokens, timings = final.usage.completion_tokens, final.timings
        self.ttft.record(timings.ttft_s)
        if tokens > 1:
            self.tpot.record((timings.total_s - timings.ttft_s) / (tokens - 1))
        self.prompt_tokens.record(final.usage.prompt_tokens)
        self.generation_tokens.record(tokens)

    async def _stream(self, rid: str, ids: list[int], sampling, call, started: float):
        """The responses of one request across its attempts: a decode instance that is unreachable before
        the first token is replaced (a retry); one that dies after tokens were streamed is replaced by
        another that resumes after them (a migration, at most `migration_limit` times): the client sees one
        stream, with no gap and no repeat."""
        with server_span(call, "router.generate", request_id=rid, prompt_tokens=len(ids)) as span:
            failed: set[str] = set()  # decode instances that failed this request
            forwarded: list[int] = []  # the token ids the client has
            first_at, migrations = None, 0
            while True:
                chosen, blocks = await self._route(ids, failed, resumed=len(forwarded))
                try:
                    async for response in self._responses(rid, ids, sampling, chosen, call, forwarded):
                        if response.HasField("delta"):
                            forwarded += response.delta.token_ids
                            first_at = first_at or time.monotonic()
                        else:
                            self._complete(response.final, rid, ids, started, first_at)
                            span.set_attribute("completion_tokens", response.final.usage.completion_tokens)
                        yield response
                    return
                except grpc.RpcError as e:
                    gone = e.code() is grpc.StatusCode.UNAVAILABLE
                    if gone and not forwarded:  # before its first token: try another instance
                        failed.add(chosen.decode.id)
                        span.add_event("retry", {"unavailable": chosen.decode.id})
                        self.retries.add(1)
                        continue
                    if gone and migrations < self.settings.migration_limit:  # mid-stream: resume elsewhere
                        failed.add(chosen.decode.id)
                        migrations += 1
                        span.add_event("migrated", {"from": chosen.decode.id, "tokens": len(forwarded)})
                        self.migrations.add(1)
                        continue
                    raise from_status(e.code(), f"{chosen.decode.id}: {e.details()}") from None
                finally:
                    self._unroute(chosen, blocks)

    @staticmethod
    def _complete(final: inference_pb2.Final, rid: str, ids: list[int], started: float, first_at: float | None):
        """The final response as the client gets it: its request, prompt and timings from the first attempt."""
        end = time.monotonic()
        final.request_id = rid
        final.prompt_token_ids[:] = ids
        tokens = final.usage.completion_tokens
        final.timings.CopyFrom(common_pb2.Timings(
            ttft_s=(first_at or end) - started, total_s=end - started,
            tokens_per_s=(tokens - 1) / (end - first_at) if first_at and end > first_at and tokens > 1 else 0.0))

    async def _route(self, ids: list[int], failed: set[str], resumed: int):
        """The instances for one try, counted against the chosen decode instance's load until `_unroute`:
        choosing and counting are one step, so each request of a burst sees the ones routed before it.
        After a migration the new decode instance holds the prompt and the `resumed` tokens."""
        with child_span("router.route") as route_span:
            # the hashes in the block size last seen (decode enforces one for all), read with the instances
            chain = prefix_hashes(ids, self._block_size) if self._block_size else []
            everyone, hits = await self._read_registry(chain)
            decodes = [d for d in everyone if d.role is Role.DECODE and d.id not in failed]
            prefills = [i for i in everyone if i.role is Role.PREFILL]
            block_size = next((d.block_size for d in decodes if d.block_size), 0)
            if block_size != self._block_size:  # the first request, or a mesh that changed: read the hits again
                self._block_size = block_size
                chain = prefix_hashes(ids, block_size) if block_size else []
                hits = self.registry.prefix_hits(chain) if chain else {}  # from memory: read just now
            try:
                chosen = route(prompt_tokens=len(ids), decodes=[self._with_routed(d) for d in decodes],
                               prefills=prefills, policy=self.settings.policy, turn=next(self._turns),
                               prefix_hits=hits, block_size=block_size,
                               local_prefill_max_tokens=self.settings.local_prefill_max_tokens,
                               max_active=self.settings.shed_active_requests)
            except NoInstance as e:
                unreachable = f" (unreachable: {', '.join(sorted(failed))})" if failed else ""
                raise NoInstance(f"{e}{unreachable}") from None
            blocks = -(-(len(ids) + resumed) // max(chosen.decode.block_size, 1))
            routed = self._routed.setdefault(chosen.decode.id, [0, 0])
            routed[0], routed[1] = routed[0] + 1, routed[1] + blocks
            route_span.set_attributes({"decode": chosen.decode.id, "reason": chosen.reason,
                                       "prefill": chosen.prefill.id if chosen.prefill else ""})
        return chosen, blocks

    async def _read_registry(self, chain: list[int]):
        """The instances and the prefix hits of `chain`: from the snapshot in memory, or, when it must read the
        registry first, read on a thread (a registry that hangs must not stall every stream on the loop)."""
        if self.registry.due():
            return await asyncio.to_thread(self.registry.instances_and_hits, chain)
        return self.registry.instances_and_hits(chain)

    def _with_routed(self, decode):
        """The registry's record of `decode`, its load raised to what this router has routed there itself."""
        routed = self._routed.get(decode.id)
        if routed is None:
            return decode
        requests, blocks = routed
        return dataclasses.replace(decode, active_requests=max(decode.active_requests, requests),
                                   kv_blocks_used=max(decode.kv_blocks_used, blocks))

    def _unroute(self, chosen, blocks: int) -> None:
        """A try ended (finished, failed or left); its routing decision is counted now, off its first token's path."""
        routed = self._routed[chosen.decode.id]
        routed[0], routed[1] = routed[0] - 1, routed[1] - blocks
        if routed[0] == 0:
            del self._routed[chosen.decode.id]
        self.routes.add(1, {"decision": chosen.decision.value})

    async def _responses(self, rid: str, ids: list[int], sampling, chosen, call, resume: list[int]):
        """One try on the chosen instances: the decode instance's responses. After a migration (`resume`:
        the tokens already streamed) the new decode instance prefills prompt and tokens itself and goes on."""
        reserved = chosen.prefill is not None and not resume
        # (unary calls to decode only for a reservation: the request itself goes on the shared stream)
        decode = internal_pb2_grpc.DecodeStub(self.channels.get(chosen.decode.address)) if reserved else None
        local = internal_pb2.DecodeRequest(request_id=rid, prefill_locally=True, prompt_token_ids=ids,
                                           sampling=sampling, resume_token_ids=resume)

        async def stream(request: internal_pb2.DecodeRequest):
            responses = self.decode_streams.decode(chosen.decode.address, request, timeout=self._remaining(call))
            try:  # a client that leaves cancels this task: closing the call cancels the request on decode
                async for response in responses:
                    yield response
            finally:
                responses.close()

        finished = False
        try:
            if not reserved:
                async for response in stream(local):
                    yield response
            else:
                join = await self._disaggregate(rid, ids, sampling, chosen, decode, outgoing_metadata(),
                                                self._remaining(call))
                try:
                    async for response in stream(join):
                        yield response
                except grpc.RpcError as e:
                    if e.code() is not grpc.StatusCode.NOT_FOUND:
                        raise
                    # the reservation's lease ran out before its KV came (a long prefill queue): decode prefills it
                    trace.get_current_span().add_event("reservation expired", {"decode": chosen.decode.id})
                    self.retries.add(1)
                    async for response in stream(local):
                        yield response
            finished = True
        finally:
            if reserved and not finished:  # a reservation Decode may never have joined: free it now (else a no-op)
                task = asyncio.ensure_future(self._cancel(decode, rid))  # not awaited: this task may be cancelled
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)

    @staticmethod
    async def _cancel(decode, rid: str) -> None:
        """Best effort, on its own short deadline (the request's may have passed); a lease frees it otherwise."""
        try:
            await decode.Cancel(internal_pb2.CancelRequest(request_id=rid), timeout=CANCEL_TIMEOUT_S)
        except grpc.RpcError:
            pass

    async def _disaggregate(self, rid, ids, sampling, chosen, decode, metadata, timeout) -> internal_pb2.DecodeRequest:
        reserved = await decode.Reserve(internal_pb2.ReserveRequest(request_id=rid, prompt_token_ids=ids,
                                                                    sampling=sampling, transport=self.kv_transport),
                                        timeout=timeout, metadata=metadata)
        target = reserved.target
        try:
            prefill = internal_pb2_grpc.PrefillStub(self.channels.get(chosen.prefill.address))
            done = await prefill.Prefill(internal_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids,
                                                                     sampling=sampling, target=target),
                                         timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:  # out of time: no recompute on decode either
                raise DeadlineExceeded(f"prefill on {chosen.prefill.id}: {e.details()}") from None
            # the prefill instance failed: decode recomputes the prompt in its reservation
            return internal_pb2.DecodeRequest(request_id=rid, kv_status=internal_pb2.KV_STATUS_FAILED)
        logprobs = done.first_logprobs if done.HasField("first_logprobs") else None
        return internal_pb2.DecodeRequest(request_id=rid, first_token_id=done.first_token_id, kv_status=done.kv_status,
                                          first_logprobs=logprobs)

    def _remaining(self, call) -> float:
        remaining = call.time_remaining()
        limit = self.settings.request_timeout_s
        return min(remaining, limit) if remaining is not None else limit

    async def close(self) -> None:
        """On the router's event loop: the decode streams and channels closed."""
        self.decode_streams.close()
        await asyncio.gather(*self._cancels, return_exceptions=True)
        await self.channels.aclose()
