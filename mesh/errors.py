"""The gRPC edge of the typed failures in `engine.errors`: one table from type to status code.

Every server `mesh.rpc.start_server` builds carries `StatusInterceptor` (`AsyncStatusInterceptor` on a
grpc.aio server, for coroutine handlers and plain ones alike): a `ServingError` raised by
any handler (also mid-stream) ends the call with its type's status code and its message. Handlers
raise the types and never pick codes. A type missing from the table takes the code of its nearest
base class that is in it; anything else is a bug and reaches gRPC as UNKNOWN. `from_status` reads
the table backwards: a peer's failed call as a typed error, so a service that relays it (the router)
raises types too. This module imports
only `engine.errors` of the engine (plain Python, no torch), so every service may use it.
"""

from __future__ import annotations

import inspect
import typing

import grpc

from engine.errors import (
    Cancelled,
    DeadlineExceeded,
    Draining,
    KVCacheFull,
    NoReservation,
    Overloaded,
    PeerFailed,
    RequestError,
    ServingError,
    Unauthenticated,
    Unavailable,
    UnknownModel,
    Unsupported,
)

STATUS_CODES: dict[type[ServingError], grpc.StatusCode] = {
    RequestError: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    KVCacheFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoReservation: grpc.StatusCode.NOT_FOUND,
    UnknownModel: grpc.StatusCode.NOT_FOUND,
    Unsupported: grpc.StatusCode.FAILED_PRECONDITION,
    Cancelled: grpc.StatusCode.CANCELLED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Draining: grpc.StatusCode.UNAVAILABLE,
    PeerFailed: grpc.StatusCode.UNAVAILABLE,
}


def status_code(error: ServingError) -> grpc.StatusCode:
    """The code of the error's type, or of its nearest base class in the table."""
    for kind in type(error).__mro__:
        if kind in STATUS_CODES:
            return STATUS_CODES[kind]
    return grpc.StatusCode.UNKNOWN  # ServingError itself: a failure nobody classified


_TYPES_BY_CODE = {code: kind for kind, code in reversed(STATUS_CODES.items())}  # per code its most general type


def from_status(code: grpc.StatusCode, message: str) -> ServingError:
    """A peer's failed call as the type the table gives its code; `PeerFailed` for a code it does not list."""
    return _TYPES_BY_CODE.get(code, PeerFailed)(message)


class StatusInterceptor(grpc.ServerInterceptor):
    """Ends a call whose handler raised a `ServingError` with the table's code and the error's message, and
    one whose request does not parse (bytes that are not the message, invalid UTF-8 in a string field) with
    INVALID_ARGUMENT, where gRPC alone would answer INTERNAL."""

    def intercept_service(self, continuation, handler_call_details):
        return _intercepted(continuation(handler_call_details))


class AsyncStatusInterceptor(grpc.aio.ServerInterceptor):
    """`StatusInterceptor` on a grpc.aio server: coroutine handlers get coroutine wrappers, plain ones (run on
    the server's threads) the same wrappers as on a sync server."""

    async def intercept_service(self, continuation, handler_call_details):
        return _intercepted(await continuation(handler_call_details))


def _intercepted(handler):
    if handler is None:
        return None
    if not handler.request_streaming and handler.request_deserializer is not None:
        handler = handler._replace(request_deserializer=_parsing(handler.request_deserializer))
    if handler.response_streaming:  # unary_stream or stream_stream: failures may come mid-stream
        kind = "stream_stream" if handler.request_streaming else "unary_stream"
        behaviour = getattr(handler, kind)
        wrap = _async_streaming if inspect.isasyncgenfunction(behaviour) else _streaming
    else:
        kind = "stream_unary" if handler.request_streaming else "unary_unary"
        behaviour = getattr(handler, kind)
        wrap = _async_unary if inspect.iscoroutinefunction(behaviour) else _unary
    return handler._replace(**{kind: wrap(behaviour)})


class _Malformed(typing.NamedTuple):
    """A request that did not parse, carried to the handler so that the call ends with a clear status."""

    error: str


def _parsing(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # protobuf's DecodeError, or whatever a custom deserializer raises
            return _Malformed(f"the request does not parse ({e}); string fields must be valid UTF-8")
    return parse


def _unary(behaviour):
    def call(request, context):
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            return behaviour(request, context)
        except ServingError as e:
            context.abort(status_code(e), str(e))
    return call


def _streaming(behaviour):
    def call(request, context):
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            yield from behaviour(request, context)
        except ServingError as e:
            _end_stream(context, e)
    return call


def _async_unary(behaviour):
    async def call(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            return await behaviour(request, context)
        except ServingError as e:
            await context.abort(status_code(e), str(e))
    return call


def _async_streaming(behaviour):
    async def call(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            async for response in behaviour(request, context):
                yield response
        except ServingError as e:
            _end_stream(context, e)
    return call


def _end_stream(context, error: ServingError) -> None:
    """The status a stream ends with once its handler returns. No abort: on a grpc.aio server a plain
    handler's abort races the write of its last response (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS)."""
    context.set_code(status_code(error))
    context.set_details(str(error))
