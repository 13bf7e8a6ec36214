"""Every service (on a sync gRPC server or a grpc.aio one): health and reflection for clients that know
nothing of our stubs; trace context across hops."""

from __future__ import annotations

import json
import multiprocessing

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from mesh.loop import LoopThread
from mesh.rpc import channel, start_server
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc


class FixedStatus(internal_pb2_grpc.AdminServicer):
    def Status(self, request, context):
        from mesh.telemetry import server_span

        with server_span(context, "admin.status", instance="x"):
            return internal_pb2.InstanceStatus(id="x", kv_blocks_total=42)


@pytest.fixture(params=["sync server", "aio server"])
def admin_server(request):
    loop = LoopThread("test-loop") if request.param == "aio server" else None
    server, port, health = start_server("127.0.0.1", 0, [(internal_pb2_grpc.add_AdminServicer_to_server, FixedStatus(),
                                                          "infermesh.v1.Admin")], loop=loop)
    yield f"127.0.0.1:{port}", health
    server.stop(None).wait()
    if loop is not None:
        loop.stop()


def by_reflection(address: str, service: str, method_name: str):
    """(the services the server lists, the response of calling `service`/`method_name` with an empty request),
    with nothing but what reflection tells."""
    with grpc.insecure_channel(address) as ch:
        database = ProtoReflectionDescriptorDatabase(ch)
        services = set(database.get_services())
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName(service).FindMethodByName(method_name)
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        call = ch.unary_unary(f"/{service}/{method_name}", request_serializer=request_class.SerializeToString,
                              response_deserializer=response_class.FromString)
        return services, call(request_class(), timeout=10)


def test_a_client_without_our_stubs_lists_and_calls_the_service_by_reflection(admin_server):
    address, _ = admin_server
    services, response = by_reflection(address, "infermesh.v1.Admin", "Status")
    assert "infermesh.v1.Admin" in services
    assert response.id == "x" and response.kv_blocks_total == 42


def test_the_standard_health_service_reports_each_service(admin_server):
    address, health = admin_server
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert stub.Check(health_pb2.HealthCheckRequest(service="infermesh.v1.Admin"), timeout=10).status == serving
        health.set("infermesh.v1.Admin", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
        assert stub.Check(health_pb2.HealthCheckRequest(service="infermesh.v1.Admin"), timeout=10).status != serving
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="infermesh.v1.Nope"), timeout=10)
        assert e.value.code() is grpc.StatusCode.NOT_FOUND


def traced_client(address: str, path: str) -> None:
    from mesh.telemetry import outgoing_metadata, setup_tracing, tracer

    provider = setup_tracing(f"file:{path}", "client")
    with tracer().start_as_current_span("client.call"):
        internal_pb2_grpc.AdminStub(channel(address)).Status(internal_pb2.StatusRequest(), metadata=outgoing_metadata(),
                                                             timeout=10)
    provider.shutdown()


def traced_server(path: str, ready, stop) -> None:
    from mesh.telemetry import setup_tracing

    provider = setup_tracing(f"file:{path}", "server")
    server, port, _ = start_server("127.0.0.1", 0, [(internal_pb2_grpc.add_AdminServicer_to_server, FixedStatus(),
                                                     "infermesh.v1.Admin")])
    ready.put(port)
    stop.wait(60)
    server.stop(None)
    provider.shutdown()


def test_one_call_is_one_trace_across_two_processes_in_one_file(tmp_path):
    path = str(tmp_path / "spans.jsonl")
    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Queue(), spawn.Event()
    server = spawn.Process(target=traced_server, args=(path, ready, stop))
    server.start()
    try:
        client = spawn.Process(target=traced_client, args=(f"127.0.0.1:{ready.get(timeout=60)}", path))
        client.start()
        client.join(60)
        assert client.exitcode == 0
    finally:
        stop.set()
        server.join(30)
    spans = {s["name"]: s for s in map(json.loads, open(path).read().splitlines())}
    assert spans["admin.status"]["trace_id"] == spans["client.call"]["trace_id"]
    assert spans["admin.status"]["parent_id"] == spans["client.call"]["span_id"]
    assert spans["admin.status"]["pid"] != spans["client.call"]["pid"]
    assert spans["admin.status"]["service"] == "server" and spans["admin.status"]["attributes"] == {"instance": "x"}


class _CallerMetadata:
    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


def untraced_hop(caller: str, out) -> None:
    """A server that records no spans (trace `none`): what it passes on to the next hop, and whether it records."""
    from mesh.telemetry import child_span, outgoing_metadata, recording, server_span

    with server_span(_CallerMetadata([("traceparent", caller)]), "hop.request"), child_span("hop.route"):
        out.put((recording(), dict(outgoing_metadata())))


def test_a_hop_that_records_no_spans_passes_the_callers_trace_on():
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    spawn = multiprocessing.get_context("spawn")  # a process of its own: no tracer provider set by another test
    out = spawn.Queue()
    hop = spawn.Process(target=untraced_hop, args=(caller, out))
    hop.start()
    recording, metadata = out.get(timeout=60)
    hop.join(30)
    assert recording is False and metadata["traceparent"] == caller


def test_a_bad_trace_spec_is_refused():
    from mesh.telemetry import setup_tracing

    with pytest.raises(ValueError, match="trace must be none, console, otlp or file:PATH, got 'jaeger'"):
        setup_tracing("jaeger", "x")


def test_a_collector_that_hangs_holds_up_no_span_and_a_file_gets_each_span_as_it_ends(tmp_path, monkeypatch):
    """OTLP spans go out in batches from a thread of their own: with an exporter that never returns (a
    collector gone silent) ending a span returns at once, and shutdown hands it the span; a file exporter
    has each span on disk as soon as it ends."""
    import threading

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from mesh.telemetry import JsonLinesExporter, span_processor

    class Hanging(SpanExporter):
        def __init__(self) -> None:
            self.calls, self.release = threading.Event(), threading.Event()

        def export(self, spans):
            self.calls.set()
            self.release.wait(30)
            return SpanExportResult.SUCCESS

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # no timed batch before shutdown, however slow the host
    hanging, path = Hanging(), tmp_path / "spans.jsonl"
    remote, local = TracerProvider(), TracerProvider()
    remote.add_span_processor(span_processor("otlp", hanging))
    local.add_span_processor(span_processor(f"file:{path}", JsonLinesExporter(str(path))))
    finished = threading.Event()

    def request():
        with remote.get_tracer("t").start_as_current_span("router.generate"):
            pass
        finished.set()

    threading.Thread(target=request, daemon=True).start()
    assert finished.wait(10) and not hanging.calls.is_set()  # ended, and nothing was sent on its way
    with local.get_tracer("t").start_as_current_span("decode.request"):
        pass
    assert json.loads(path.read_text())["name"] == "decode.request"
    hanging.release.set()
    remote.shutdown()
    assert hanging.calls.is_set()
