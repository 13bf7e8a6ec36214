"""What the structure promises: the router process loads no torch; one registry names every KV transport
(name, wire enum, implementing module) and a decode instance offers each one its device can run; every
decode instance of a mesh uses one KV block size, which the router reads from the registry."""

from __future__ import annotations

import subprocess
import sys

import grpc
import httpx
import pytest

from decode_svc.server import DecodeInstance
from engine.errors import Unsupported
from kvtransfer import transports
from mesh.registry import MemoryRegistry
from mesh.settings import DecodeSettings, RouterSettings
from protos.infermesh.v1 import internal_pb2, internal_pb2_grpc
from router.server import RouterInstance
from tests.helpers import wait_until


def test_importing_and_building_the_router_leaves_torch_out():
    code = ("import sys, router.server\n"
            "from engine.model_info import load_model_info\n"
            "load_model_info('smollm2-135m')\n"
            "print(sorted(m for m in ('torch', 'engine.core', 'engine.sampler') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_transport_is_one_entry_by_name_and_by_wire_value():
    assert transports.NAMES == ("grpc_stream", "torch_p2p", "shared_memory", "mooncake")
    for t in transports.TRANSPORTS:
        assert transports.by_name(t.name) is t and transports.by_wire(t.wire) is t
        parts = t.load()
        assert all(callable(part) for part in (parts.dialer, parts.shared, parts.endpoint))
    with pytest.raises(ValueError, match="kv_transport must be one of grpc_stream, torch_p2p, shared_memory, "
                                         "mooncake, got 'carrier_pigeon'"):
        transports.by_name("carrier_pigeon")
    with pytest.raises(Unsupported, match="got KV_TRANSPORT_UNSPECIFIED"):
        transports.by_wire(internal_pb2.KV_TRANSPORT_UNSPECIFIED)
    with pytest.raises(Unsupported, match="got 99"):
        transports.by_wire(99)
    assert [t.usable("cuda") for t in transports.TRANSPORTS] == [True, False, True, True]  # torch_p2p: gloo


def test_a_decode_instance_offers_every_transport_usable_on_its_device(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    decode = DecodeInstance(DecodeSettings(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22))
    try:
        assert set(decode.kv_endpoints) == {"grpc_stream", "torch_p2p", "shared_memory", "mooncake"}
        assert decode.kv_endpoints["torch_p2p"] == [decode.shared["torch_p2p"].address]  # its pairing store
        assert decode.kv_endpoints["grpc_stream"] != [decode.address]  # a KVTransfer server of the rank's own
    finally:
        decode.stop()


def test_a_decode_instance_whose_block_size_differs_from_the_registered_ones_refuses_to_start(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22)
    first = DecodeInstance(DecodeSettings(block_size=16, **common), registry=registry)
    try:
        wait_until(lambda: [i.block_size for i in registry.instances()] == [16])  # published with its record
        with pytest.raises(ValueError, match=r"block_size=8 differs from the registered decode instances' \(16\)"):
            DecodeInstance(DecodeSettings(block_size=8, **common), registry=registry)
        DecodeInstance(DecodeSettings(block_size=16, **common), registry=registry).stop()
    finally:
        first.stop()


def test_an_instance_listens_on_bind_host_and_is_published_at_host(tiny_checkpoint):
    """In a pod: listen on every interface (port-forward reaches 127.0.0.1), publish the pod's address."""
    folder, _ = tiny_checkpoint("llama")
    registry = MemoryRegistry()
    router = RouterInstance(RouterSettings(model=str(folder), host="127.0.0.2", bind_host="0.0.0.0", http_port=0),
                            registry=registry)
    try:
        wait_until(lambda: len(registry.instances()) == 1)
        (record,) = registry.instances()
        port = int(record.address.rsplit(":", 1)[1])
        assert record.address.startswith("127.0.0.2:") and record.http_address.startswith("127.0.0.2:")
        assert record.metrics_url.startswith("http://127.0.0.2:")
        for host in ("127.0.0.1", "127.0.0.2"):  # every interface answers
            with grpc.insecure_channel(f"{host}:{port}") as ch:
                assert internal_pb2_grpc.AdminStub(ch).Status(internal_pb2.StatusRequest(), timeout=10).id == router.id
            http_port = record.http_address.rsplit(":", 1)[1]
            assert httpx.get(f"http://{host}:{http_port}/health").status_code == 200
    finally:
        router.stop()
