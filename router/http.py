"""The router's OpenAI-compatible HTTP front: Starlette on uvicorn, on the router's event loop (`mesh.loop`,
beside its grpc.aio server).

    GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health

Every request goes the gRPC face's way: `RouterCore.admit`, prompts, then `RouterCore.stream` once per
choice (a task each, so each stream keeps its trace context), with an `HttpCall` standing in for gRPC's
context: the router's request timeout as the deadline, the client's headers as trace context (W3C
`traceparent` honoured). When the client disconnects (watched for the whole request, streamed or not)
the choices' tasks are cancelled, and the work downstream with them — decode then frees the request's
KV blocks. Failures are the same types as on gRPC, mapped by
`openai_api.HTTP_STATUSES` to statuses and OpenAI error bodies; one that happens after a stream started
is sent as an `error` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from dataclasses import replace

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine.errors import PeerFailed, RequestError, ServingError
from mesh import tls
from mesh.loop import LoopThread
from router import openai_api
from router.core import RouterCore

STARTUP_TIMEOUT_S = 30.0


class HttpCall:
    """What `RouterCore.stream` needs of a call, for one HTTP request."""

    def __init__(self, headers: list[tuple[str, str]], timeout_s: float) -> None:
        self.headers, self.deadline = headers, time.monotonic() + timeout_s

    def time_remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.headers


def error_response(error: ServingError) -> JSONResponse:
    status, body = openai_api.error_body(error)
    return JSONResponse(body, status_code=status)


class OpenAIResponse:
    """The ASGI response of one admitted request: its choices run as tasks while the client is watched;
    then one JSON body, or (`stream`) server-sent events as tokens arrive."""

    def __init__(self, core: RouterCore, job: openai_api.Job, prompt_ids: list[list[int]], call: HttpCall) -> None:
        self.core, self.job, self.prompt_ids, self.call = core, job, prompt_ids, call
        self.id = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self._tasks: list[asyncio.Task] = []  # one per choice
        self._stopped = False  # the client left, or the answer is over: no choice runs on

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as watching:
            watching.start_soon(self._watch, receive)
            try:
                await (self._stream(send) if self.job.stream else self._whole(scope, send))
            except OSError:  # the client is gone (the watcher stopped the choices already, or will)
                pass
            finally:
                self._stop()
                watching.cancel_scope.cancel()

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._stop()  # the client left: cancel the work downstream now

    def _stop(self) -> None:
        self._stopped = True
        for task in self._tasks:
            task.cancel()

    async def _choices(self):
        """(choice index, GenerateResponse | ServingError | None at its end), from one task per choice."""
        queue: asyncio.Queue = asyncio.Queue()
        n = self.job.n
        for p, ids in enumerate(self.prompt_ids):
            for i in range(n):
                task = asyncio.create_task(self._produce(queue, p * n + i, ids, i))
                # its end, however it ends (cancelled before it ran included)
                task.add_done_callback(lambda _, index=p * n + i: queue.put_nowait((index, None)))
                self._tasks.append(task)
                if self._stopped:  # the client left before the choices began
                    task.cancel()
        running = len(self._tasks)
        while running:
            index, item = await queue.get()
            running -= item is None
            yield index, item

    async def _produce(self, queue: asyncio.Queue, index: int, ids: list[int], choice: int) -> None:
        try:
            async for response in self.core.stream(ids, self.job.choice_sampling(choice), f"{self.id}-{index}",
                                                   self.call, self.job.default_max_tokens):
                queue.put_nowait((index, response))
        except ServingError as e:
            queue.put_nowait((index, e))
        except Exception as e:  # noqa: BLE001 - a bug must still end the choice, and say so
            queue.put_nowait((index, PeerFailed(f"the router failed: {e!r}")))

    def _token_text(self, token_id: int) -> str:
        return self.core.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _whole(self, scope, send) -> None:
        choices = [openai_api.Choice(index) for index in range(len(self.prompt_ids) * self.job.n)]
        error = None
        async for index, item in self._choices():
            if isinstance(item, ServingError):
                error = error or item
                self._stop()  # one choice failed: the answer fails, stop the others
            elif item is not None:
                openai_api.accumulate(choices[index], item)
        if error is None:
            body = openai_api.response_body(self.job, self.id, self.created, choices, self._token_text)
            response = JSONResponse(body)
        else:
            response = error_response(error)
        await response(scope, _no_receive, send)

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        choices = [openai_api.Choice(index) for index in range(len(self.prompt_ids) * self.job.n)]
        if self.job.chat:
            for choice in choices:
                await _event(send, openai_api.chunk(self.job, self.id, self.created, choice.index, role=True))
        failed = False
        async for index, item in self._choices():
            if isinstance(item, ServingError):
                if not failed:
                    await _event(send, openai_api.error_body(item)[1])
                failed = True
                self._stop()
            elif item is not None and not failed:
                await self._send_delta(send, choices[index], item)
        if self.job.include_usage and not failed:
            await _event(send, openai_api.usage_chunk(self.job, self.id, self.created, choices))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _send_delta(self, send, choice: openai_api.Choice, response) -> None:
        openai_api.accumulate(choice, response)
        if response.HasField("delta"):
            delta = response.delta
            logprobs = None
            if self.job.sampling.HasField("logprobs"):
                logprobs = (openai_api.chat_logprobs(delta.logprobs, self._token_text) if self.job.chat else
                            openai_api.completion_logprobs(delta.logprobs, self._token_text,
                                                           len(choice.text) - len(delta.text)))
            if delta.text or logprobs:
                await _event(send, openai_api.chunk(self.job, self.id, self.created, choice.index, text=delta.text,
                                                    logprobs=logprobs))
        else:
            await _event(send, openai_api.chunk(self.job, self.id, self.created, choice.index,
                                                finish_reason=choice.finish_reason))


async def _event(send, body: dict) -> None:
    await send({"type": "http.response.body", "body": f"data: {json.dumps(body)}\n\n".encode(), "more_body": True})


async def _no_receive():
    return {"type": "http.disconnect"}


class HttpFront:
    """Serves the OpenAI API for `core` on host:port (0: any free port) until `stop()`."""

    def __init__(self, core: RouterCore, loop: LoopThread, host: str, port: int, health, bind_host: str = "") -> None:
        """Served on `loop` (the one `core` runs on). `health()`: whether the router serves (GET /health says 200,
        else 503); it listens on `bind_host` ("": host) and is reached at `host`."""
        self.core, self.health = core, health
        app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/health", self.health_check, methods=["GET"]),
        ])
        listen = bind_host or host
        sock = socket.socket(socket.AF_INET6 if ":" in listen else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((listen, port))
        self.address = f"{host}:{sock.getsockname()[1]}"
        certificate, key = tls.server_files() or (None, None)  # HTTPS when the mesh speaks TLS
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                                    timeout_graceful_shutdown=5, ssl_certfile=certificate,
                                                    ssl_keyfile=key))
        self._serving = loop.submit(self.server.serve(sockets=[sock]))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if self._serving.done() or time.monotonic() > deadline:
                self.stop()
                raise OSError(f"the HTTP front did not start on {self.address}")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        try:
            self._serving.result(timeout=10)
        except Exception:  # noqa: BLE001 - stopping: what the server failed with was said when it did
            pass

    # ---- endpoints ------------------------------------------------------------------------

    async def models(self, request: Request):
        try:
            self.core.admit(request.headers.get("authorization"))
        except ServingError as e:
            return error_response(e)
        card = self.core.model_card()
        model = {"id": card.id, "object": "model", "created": 0, "owned_by": "infermesh",
                 "max_model_len": card.max_model_len}
        return JSONResponse({"object": "list", "data": [model]})

    async def health_check(self, request: Request):
        serving = self.health()
        return JSONResponse({"status": "ok" if serving else "unavailable"}, status_code=200 if serving else 503)

    async def completions(self, request: Request):
        return await self._serve(request, openai_api.parse_completion)

    async def chat(self, request: Request):
        return await self._serve(request, openai_api.parse_chat)

    async def _serve(self, request: Request, parse):
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not valid JSON: {e}") from None
            job = parse(body)
            self.core.admit(request.headers.get("authorization"), job.model)
            job = replace(job, model=job.model or self.core.settings.model)
            prompt_ids = await run_in_threadpool(self._prompt_ids, job)
        except ServingError as e:
            return error_response(e)
        call = HttpCall(list(request.headers.items()), self.core.settings.request_timeout_s)
        return OpenAIResponse(self.core, job, prompt_ids, call)

    def _prompt_ids(self, job: openai_api.Job) -> list[list[int]]:
        if job.chat:
            return [self.core.chat_ids(messages) for messages in job.prompts]
        return [self.core.prompt_ids(ids=p) if isinstance(p, list) else self.core.prompt_ids(text=p)
                for p in job.prompts]
