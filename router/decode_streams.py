"""The router's streams to its decode instances: one long-lived `Decode.Stream` per instance, shared by
every request the router sends there; grpc.aio, on the router's event loop.

Per request a stream would cost the decode process a gRPC message, and a wake of a handler thread, for
every token: at 32 concurrent requests those wakes contend with the engine's thread for the GIL and
slowed its steps by ~20 %. On a shared stream the
decode instance sends what all requests got in one engine step as one message; on the router's side one
task reads it and hands each request its events, with no thread between them and the client.

`DecodeStreams.decode(address, request, timeout)` sends the request on the instance's stream (opened on
first use, and again after one breaks) and returns its call: an async iterator of the request's responses
(its deltas, then its final response). It fails as a per-request `Decode` call would, with a
`grpc.RpcError` of the same status code: the code decode gave the request, DEADLINE_EXCEEDED when
`timeout` passes first, and UNAVAILABLE for every request in flight on a stream that breaks (the instance
died, or its connection did). `close()` ends the call: a request decode has not finished (given up on,
its deadline passed, its task cancelled) is cancelled on decode; iterating to the end or to a failure
closes it too.
"""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry import propagate

from mesh.rpc import ChannelPool
from protos.infermesh.v1 import inference_pb2, internal_pb2, internal_pb2_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}
DEADLINE = object()  # queued for a call whose deadline passed


class StreamError(grpc.RpcError):
    """A request's failure on a shared stream, as a per-request call would have raised it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class DecodeCall:
    """One request's responses on a shared stream."""

    def __init__(self, stream: "_Stream", request_id: str, events: asyncio.Queue, timeout: float) -> None:
        self._stream, self._request_id, self._events = stream, request_id, events
        # one timer for the call, not one a token: at the deadline it queues DEADLINE behind what has come
        self._deadline = asyncio.get_running_loop().call_later(timeout, events.put_nowait, DEADLINE)
        self._ended = False  # decode ended the request (its final response, or a failure) or the stream broke
        self._closed = False

    def __aiter__(self) -> "DecodeCall":
        return self

    async def __anext__(self) -> inference_pb2.GenerateResponse:
        if self._ended:
            self.close()
            raise StopAsyncIteration
        try:
            event = await self._next_event()
        except BaseException:  # a failure, or the caller's task cancelled: done with either way
            self.close()
            raise
        self._ended = event.response.HasField("final")
        return event.response

    def close(self) -> None:
        """Done with the call (again: nothing): cancelled on decode unless decode ended it."""
        if not self._closed:
            self._closed = True
            self._deadline.cancel()
            self._stream.release(self._request_id, cancel=not self._ended)

    async def _next_event(self) -> internal_pb2.StreamEvent:
        event = await self._events.get()
        if event is DEADLINE:
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if isinstance(event, grpc.RpcError):  # the stream broke: the request ended with it
            self._ended = True
            raise event
        if event.status_code:
            self._ended = True
            raise StreamError(_CODES.get(event.status_code, grpc.StatusCode.UNKNOWN), event.status_message)
        return event


class _Stream:
    """One open `Decode.Stream`: requests go out through a queue, a reader task hands each event to its
    request's queue."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._out: asyncio.Queue = asyncio.Queue()
        self._calls: dict[str, asyncio.Queue] = {}  # request id -> its events
        self.broken: grpc.RpcError | None = None
        self._call = internal_pb2_grpc.DecodeStub(channel).Stream(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    def call(self, request: internal_pb2.DecodeRequest, timeout: float) -> DecodeCall:
        if self.broken is not None:
            raise self.broken
        events: asyncio.Queue = asyncio.Queue()
        self._calls[request.request_id] = events
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the caller's trace: decode's span of the request continues it
        self._out.put_nowait(internal_pb2.StreamRequest(decode=request, trace_context=carrier))
        return DecodeCall(self, request.request_id, events, timeout)

    def release(self, request_id: str, cancel: bool) -> None:
        """The request's call is done with; `cancel`: it did not finish, cancel it on decode."""
        ours = self._calls.pop(request_id, None) is not None
        if ours and cancel and self.broken is None:
            self._out.put_nowait(internal_pb2.StreamRequest(cancel=internal_pb2.CancelRequest(request_id=request_id)))

    def close(self) -> None:
        self._out.put_nowait(None)

    async def _requests(self):
        while (request := await self._out.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for message in self._call:
                for event in message.events:
                    events = self._calls.get(event.request_id)
                    if events is not None:
                        events.put_nowait(event)
            error: grpc.RpcError = StreamError(grpc.StatusCode.UNAVAILABLE, "the decode stream ended")
        except grpc.RpcError as e:  # whatever broke it, the requests on it may go on elsewhere
            error = StreamError(grpc.StatusCode.UNAVAILABLE, f"the decode stream broke: {e.details()}")
        self.broken = error
        calls, self._calls = list(self._calls.values()), {}
        for events in calls:
            events.put_nowait(error)
        self.close()


class DecodeStreams:
    """The router's stream to each decode instance, by address (used on one event loop)."""

    def __init__(self, channels: ChannelPool) -> None:
        self._channels = channels
        self._streams: dict[str, _Stream] = {}

    def decode(self, address: str, request: internal_pb2.DecodeRequest, timeout: float) -> DecodeCall:
        stream = self._streams.get(address)
        if stream is None or stream.broken is not None:
            stream = self._streams[address] = _Stream(self._channels.get(address))
        return stream.call(request, timeout)

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
