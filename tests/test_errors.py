"""Typed failures at the gRPC edge: every type in the table, raised by a real service over loopback (a sync
server, a grpc.aio one with plain handlers and with coroutines), before a response or mid-stream, reaches
the client with the table's status code and its own message; types not in the table take their base
class's code; a peer's status read back gives the type again."""

from __future__ import annotations

import grpc
import pytest

from engine.errors import NoReservation, RequestError, ServingError, Unavailable
from engine.sampling_params import SamplingParamsError
from kvtransfer.transport import PieceRejected
from mesh.errors import STATUS_CODES, from_status, status_code
from mesh.loop import LoopThread
from mesh.rpc import channel, start_server
from protos.infermesh.v1 import inference_pb2, internal_pb2, internal_pb2_grpc
from router.policy import NoInstance


class Raising(internal_pb2_grpc.DecodeServicer):
    """Raises whatever `error` is set to: at once (Cancel) or after one streamed response (Decode)."""

    error: Exception = RuntimeError("unset")

    def Cancel(self, request, context):
        raise self.error

    def Decode(self, request, context):
        yield inference_pb2.GenerateResponse(delta=inference_pb2.Delta(text="first"))
        raise self.error


class AsyncRaising(Raising):
    """`Raising` with coroutine handlers, as a grpc.aio server runs them on its loop."""

    async def Cancel(self, request, context):
        raise self.error

    async def Decode(self, request, context):
        yield inference_pb2.GenerateResponse(delta=inference_pb2.Delta(text="first"))
        raise self.error


@pytest.fixture(scope="module", params=["sync server", "aio server, plain handlers", "aio server, coroutines"])
def raising(request):
    servicer = AsyncRaising() if request.param == "aio server, coroutines" else Raising()
    loop = None if request.param == "sync server" else LoopThread("test-loop")
    server, port, _ = start_server("127.0.0.1", 0, [(internal_pb2_grpc.add_DecodeServicer_to_server, servicer,
                                                     "infermesh.v1.Decode")], loop=loop)
    ch = channel(f"127.0.0.1:{port}")
    yield servicer, internal_pb2_grpc.DecodeStub(ch)
    ch.close()
    server.stop(None).wait()
    if loop is not None:
        loop.stop()


@pytest.mark.parametrize("kind", list(STATUS_CODES), ids=lambda kind: kind.__name__)
def test_each_type_in_the_table_ends_a_call_with_its_code_and_message(raising, kind):
    servicer, stub = raising
    servicer.error = kind(f"a {kind.__name__} happened (limit 3, got 4)")
    with pytest.raises(grpc.RpcError) as unary:
        stub.Cancel(internal_pb2.CancelRequest(request_id="r"), timeout=10)
    call = stub.Decode(internal_pb2.DecodeRequest(request_id="r"), timeout=10)
    assert next(call).delta.text == "first"  # the stream got going before it failed
    with pytest.raises(grpc.RpcError) as streaming:
        next(call)
    for e in (unary.value, streaming.value):
        assert (e.code(), e.details()) == (STATUS_CODES[kind], str(servicer.error))


@pytest.mark.parametrize("error, code", [
    (SamplingParamsError("top_p must be in (0, 1], got 2.0"), grpc.StatusCode.INVALID_ARGUMENT),
    (PieceRejected("layer 9 is out of range [0, 2)"), grpc.StatusCode.INVALID_ARGUMENT),
    (NoInstance("no decode instance is serving"), grpc.StatusCode.UNAVAILABLE),
    (ServingError("nobody classified this"), grpc.StatusCode.UNKNOWN),
])
def test_a_type_outside_the_table_takes_its_nearest_listed_base(raising, error, code):
    servicer, stub = raising
    servicer.error = error
    with pytest.raises(grpc.RpcError) as e:
        stub.Cancel(internal_pb2.CancelRequest(request_id="r"), timeout=10)
    assert (e.value.code(), e.value.details()) == (code, str(error))


def test_an_untyped_exception_is_a_bug_and_the_service_keeps_serving(raising):
    servicer, stub = raising
    servicer.error = ZeroDivisionError("oops")
    with pytest.raises(grpc.RpcError) as e:
        stub.Cancel(internal_pb2.CancelRequest(request_id="r"), timeout=10)
    assert e.value.code() is grpc.StatusCode.UNKNOWN
    servicer.error = NoReservation("request_id 'r' has no reservation")
    with pytest.raises(grpc.RpcError) as e:
        stub.Cancel(internal_pb2.CancelRequest(request_id="r"), timeout=10)
    assert e.value.code() is grpc.StatusCode.NOT_FOUND


def test_a_peer_status_reads_back_as_the_most_general_type_of_its_code():
    assert all(status_code(from_status(code, "m")) is code for code in STATUS_CODES.values())  # a round trip
    assert type(from_status(grpc.StatusCode.INVALID_ARGUMENT, "m")) is RequestError
    assert type(from_status(grpc.StatusCode.UNAVAILABLE, "m")) is Unavailable
    internal = from_status(grpc.StatusCode.INTERNAL, "decode-1: boom")  # a code the table does not list
    assert isinstance(internal, Unavailable) and str(internal) == "decode-1: boom"
