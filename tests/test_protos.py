"""protos/: the committed generated code is what the .proto sources generate today.

The generators stamp their own version into the code (grpcio-tools' GRPC_GENERATED_VERSION, protoc's
"Protobuf Python Version" and runtime check); a newer patch release of the tools than the one that made
the committed code is not staleness, so the comparison masks those stamps and nothing else.
"""

from __future__ import annotations

import re

from protos.generate import ROOT, generate

_VERSION_STAMPS = (
    re.compile(rb"(GRPC_GENERATED_VERSION = )'[^']*'"),
    re.compile(rb"(# Protobuf Python Version: )\S+"),
    re.compile(rb"(_runtime_version\.Domain\.PUBLIC,\n)\s*\d+,\n\s*\d+,\n\s*\d+,\n\s*'[^']*',\n"),
)


def without_version_stamps(code: bytes) -> bytes:
    for stamp in _VERSION_STAMPS:
        code = stamp.sub(rb"\1<version>", code)
    return code


def test_generated_code_is_not_stale(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "no generated files"
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed.relative_to(ROOT)} is missing: run `python protos/generate.py`"
        assert without_version_stamps(committed.read_bytes()) == without_version_stamps(path.read_bytes()), \
            f"{committed.relative_to(ROOT)} is stale: run `python protos/generate.py`"
    committed = {p.relative_to(ROOT) for p in (ROOT / "protos").rglob("*_pb2*.py*")}
    assert committed == {p.relative_to(tmp_path) for p in fresh}, "generated files without a .proto source"


def test_the_staleness_check_masks_generator_versions_and_nothing_else():
    grpc_stub = (ROOT / "protos/infermesh/v1/common_pb2_grpc.py").read_bytes()
    message_code = (ROOT / "protos/infermesh/v1/common_pb2.py").read_bytes()
    newer_grpc = re.sub(rb"GRPC_GENERATED_VERSION = '[^']*'", b"GRPC_GENERATED_VERSION = '9.99.9'", grpc_stub)
    newer_protoc = re.sub(rb"Domain\.PUBLIC,\n(\s*)\d+,", rb"Domain.PUBLIC,\n\g<1>99,", message_code)
    newer_protoc = re.sub(rb"Protobuf Python Version: \S+", b"Protobuf Python Version: 99.0.0", newer_protoc)
    assert newer_grpc != grpc_stub and newer_protoc != message_code
    assert without_version_stamps(newer_grpc) == without_version_stamps(grpc_stub)
    assert without_version_stamps(newer_protoc) == without_version_stamps(message_code)
    edited = message_code.replace(b"infermesh.v1", b"infermesh.v2", 1)
    assert edited != message_code and without_version_stamps(edited) != without_version_stamps(message_code)


def test_services_live_in_package_infermesh_v1():
    from protos.infermesh.v1 import inference_pb2, internal_pb2

    assert inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name == "infermesh.v1.Inference"
    assert {"Decode", "Prefill", "KVTransfer", "Admin"} <= set(internal_pb2.DESCRIPTOR.services_by_name)
    assert internal_pb2.KVTransport.Name(internal_pb2.KV_TRANSPORT_TORCH_P2P) == "KV_TRANSPORT_TORCH_P2P"
