"""The router process: the public `infermesh.v1.Inference` gRPC service and, with `--http-port`, the
OpenAI-compatible HTTP front (`router.http`) — two faces over one path (`router.core`: checks, routing,
streaming, retries) — in the shared lifecycle of `mesh.instance` (its in-flight work: its streams).
Both faces and every client the core calls run on one asyncio event loop (`mesh.loop`): grpc.aio for
gRPC, uvicorn for HTTP.

    python -m router.server --port 8000 --model smollm2-135m --registry redis://127.0.0.1:6379 [--http-port 8001]

With `--api-token` (or INFERMESH_API_TOKEN) both faces need `authorization: Bearer <token>`.
"""

from __future__ import annotations

import asyncio
import uuid

from mesh.auth import bearer
from mesh.instance import Instance
from mesh.loop import LoopThread
from mesh.registry import InstanceState, Registry, Role
from mesh.registry.snapshot import Snapshot
from mesh.service import serve
from mesh.settings import RouterSettings
from protos.infermesh.v1 import inference_pb2, inference_pb2_grpc
from router.core import RouterCore
from router.http import HttpFront
from router.planner_watch import PlannerWatch

TOKENIZE_ON_THE_LOOP_CHARS = 4096  # longer prompts are tokenized on a thread (`_tokenized`)


class InferenceService(inference_pb2_grpc.InferenceServicer):
    """The gRPC face."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def ListModels(self, request, context):
        self.core.admit(bearer(context.invocation_metadata()))
        return inference_pb2.ListModelsResponse(models=[self.core.model_card()])

    async def Generate(self, request, context):
        self.core.admit(bearer(context.invocation_metadata()), request.model)
        if request.HasField("token_ids"):
            ids = self.core.prompt_ids(ids=list(request.token_ids.ids))
        else:
            ids = await _tokenized(len(request.text), self.core.prompt_ids, text=request.text)
        async for response in self.core.stream(ids, request.sampling, _request_id(request.request_id), context):
            yield response

    async def Chat(self, request, context):
        self.core.admit(bearer(context.invocation_metadata()), request.model)
        messages = [(m.role, m.content) for m in request.messages]
        ids = await _tokenized(sum(len(content) for _, content in messages), self.core.chat_ids, messages)
        async for response in self.core.stream(ids, request.sampling, _request_id(request.request_id), context):
            yield response


async def _tokenized(chars: int, tokenize, *args, **kwargs) -> list[int]:
    """`tokenize(...)`: on the event loop for a short prompt, on a thread for a long one, whose tokenizing would
    hold up every stream the loop relays (~1 ms at 4,096 characters, ~0.4 s at 1 MB)."""
    if chars <= TOKENIZE_ON_THE_LOOP_CHARS:
        return tokenize(*args, **kwargs)
    return await asyncio.to_thread(tokenize, *args, **kwargs)


def _request_id(given: str) -> str:
    return given or f"req-{uuid.uuid4().hex[:12]}"


class RouterInstance(Instance):
    """A router: both faces over one core, and the shared gRPC shell."""

    role = Role.ROUTER
    max_request_bytes = 4 << 20  # a public request: far over any context's worth of text or token ids
    client_certs = False  # the public port: clients need no certificate (the API token guards it)

    def __init__(self, settings: RouterSettings, registry: Registry | None = None) -> None:
        super().__init__(settings, registry=registry)
        self.loop = LoopThread(f"{self.id}-loop")  # the gRPC server, the HTTP front and the core's clients run on it
        self.http = None
        try:
            # routing reads the registry from memory, refreshed as requests come, and survives outages
            self.core = RouterCore(settings, Snapshot(self.registry, settings.registry_refresh_s), self.admit,
                                   self.metrics)
            if settings.http_port is not None:
                self.http = HttpFront(self.core, self.loop, settings.host, settings.http_port,
                                      bind_host=settings.bind_host,
                                      health=lambda: self.state is InstanceState.SERVING)
            self.serve([(inference_pb2_grpc.add_InferenceServicer_to_server, InferenceService(self.core),
                         "infermesh.v1.Inference")])
        except BaseException:
            if self.http is not None:
                self.http.stop()
            self.loop.stop()
            raise
        self.planner = PlannerWatch(self.metrics, self.core.registry.instances, settings.planner(),
                                    settings.planner_interval_s)

    def describe(self) -> dict:
        return {"http_address": self.http.address if self.http else ""}

    def in_flight(self) -> int:
        return self.core.active

    def close(self) -> None:
        self.planner.stop()
        try:
            if self.http is not None:
                self.http.stop()
            self.loop.run(self.core.close(), timeout_s=10)
        finally:
            self.loop.stop()


def main(argv: list[str] | None = None) -> None:
    serve("router", RouterSettings, RouterInstance, argv)


if __name__ == "__main__":
    main()
