"""The router's streams to its decode instances: one long-lived `Decode.Stream` per instance, shared by
every request the router sends there.

Per request a stream would cost the decode process a gRPC message, and a wake of a handler thread, for
every token: at 32 concurrent requests those wakes contend with the engine's thread for the GIL and
slowed its steps by ~20 % (bench/RESULTS.md, "one stream per decode instance"). On a shared stream the
decode instance sends what all requests got in one engine step as one message.

`DecodeStreams.decode(address, request, timeout)` sends the request on the instance's stream (opened on
first use, and again after one breaks) and returns its call: an iterator of the request's responses (its
deltas, then its final response) with `cancel()`. It fails as a per-request `Decode` call would, with a
`grpc.RpcError` of the same status code: the code decode gave the request, DEADLINE_EXCEEDED when
`timeout` passes first (the request is then cancelled on decode), and UNAVAILABLE for every request in
flight on a stream that breaks (the instance died, or its connection did). A call given up on (cancelled,
its deadline passed, or left unread) is cancelled on decode; a request that finished is not.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import grpc
from opentelemetry import propagate

from mesh.rpc import ChannelPool
from protos.infermesh.v1 import inference_pb2, internal_pb2, internal_pb2_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_CANCELLED = object()  # put in a call's queue by `cancel()`


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
    """One request's responses on a shared stream (an iterator; no generator, so that a call dropped unread
    is released, and cancelled, as soon as nothing refers to it)."""

    def __init__(self, stream: "_Stream", request_id: str, events: queue.Queue, timeout: float) -> None:
        self._stream, self._request_id, self._events = stream, request_id, events
        self._deadline = time.monotonic() + timeout
        self._ended = False  # decode ended the request (its final response, or a failure) or the stream broke

    def __iter__(self) -> Iterator[inference_pb2.GenerateResponse]:
        return self

    def __next__(self) -> inference_pb2.GenerateResponse:
        if self._ended:
            raise StopIteration
        try:
            event = self._next_event()
        except grpc.RpcError:
            self._release()
            raise
        self._ended = event.response.HasField("final")
        if self._ended:
            self._release()
        return event.response

    def cancel(self) -> None:
        self._events.put(_CANCELLED)

    def __del__(self) -> None:
        self._release()

    def _release(self) -> None:  # the call is done with: cancelled on decode unless decode ended it
        self._stream.release(self._request_id, cancel=not self._ended)

    def _next_event(self) -> internal_pb2.StreamEvent:
        remaining = self._deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise queue.Empty
            event = self._events.get(timeout=remaining)
        except queue.Empty:
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if event is _CANCELLED:
            raise StreamError(grpc.StatusCode.CANCELLED, "Cancelled")
        if isinstance(event, grpc.RpcError):  # the stream broke: the request ended with it
            self._ended = True
            raise event
        if event.status_code:
            self._ended = True
            raise StreamError(_CODES.get(event.status_code, grpc.StatusCode.UNKNOWN), event.status_message)
        return event


class _Stream:
    """One open `Decode.Stream`: requests go out through a queue, a reader thread hands each event to its
    request's queue."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._out: queue.Queue = queue.Queue()
        self._calls: dict[str, queue.Queue] = {}  # request id -> its events
        self._lock = threading.Lock()
        self.broken: grpc.RpcError | None = None
        responses = internal_pb2_grpc.DecodeStub(channel).Stream(iter(self._out.get, None))
        threading.Thread(target=self._read, args=(responses,), name="decode-stream", daemon=True).start()

    def call(self, request: internal_pb2.DecodeRequest, timeout: float) -> DecodeCall:
        events: queue.Queue = queue.Queue()
        with self._lock:
            if self.broken is not None:
                raise self.broken
            self._calls[request.request_id] = events
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the caller's trace: decode's span of the request continues it
        self._out.put(internal_pb2.StreamRequest(decode=request, trace_context=carrier))
        return DecodeCall(self, request.request_id, events, timeout)

    def release(self, request_id: str, cancel: bool) -> None:
        """The request's call is done with (again: nothing); `cancel`: it did not finish, cancel it on decode."""
        with self._lock:
            ours = self._calls.pop(request_id, None) is not None
        if ours and cancel and self.broken is None:
            self._out.put(internal_pb2.StreamRequest(cancel=internal_pb2.CancelRequest(request_id=request_id)))

    def close(self) -> None:
        self._out.put(None)

    def _read(self, responses) -> None:
        try:
            for message in responses:
                for event in message.events:
                    with self._lock:
                        events = self._calls.get(event.request_id)
                    if events is not None:
                        events.put(event)
            error: grpc.RpcError = StreamError(grpc.StatusCode.UNAVAILABLE, "the decode stream ended")
        except grpc.RpcError as e:  # whatever broke it, the requests on it may go on elsewhere
            error = StreamError(grpc.StatusCode.UNAVAILABLE, f"the decode stream broke: {e.details()}")
        with self._lock:
            self.broken = error
            calls, self._calls = list(self._calls.values()), {}
        for events in calls:
            events.put(error)
        self.close()


class DecodeStreams:
    """The router's stream to each decode instance, by address."""

    def __init__(self, channels: ChannelPool) -> None:
        self._channels = channels
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    def decode(self, address: str, request: internal_pb2.DecodeRequest, timeout: float) -> DecodeCall:
        with self._lock:
            stream = self._streams.get(address)
            if stream is None or stream.broken is not None:
                stream = self._streams[address] = _Stream(self._channels.get(address))
        return stream.call(request, timeout)

    def close(self) -> None:
        with self._lock:
            for stream in self._streams.values():
                stream.close()
            self._streams.clear()
