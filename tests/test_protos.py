"""protos/: the committed generated code is what the .proto sources generate today."""

from __future__ import annotations

from protos.generate import ROOT, generate


def test_generated_code_is_not_stale(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "no generated files"
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed.relative_to(ROOT)} is missing: run `python protos/generate.py`"
        assert committed.read_bytes() == path.read_bytes(), \
            f"{committed.relative_to(ROOT)} is stale: run `python protos/generate.py`"
    committed = {p.relative_to(ROOT) for p in (ROOT / "protos").rglob("*_pb2*.py*")}
    assert committed == {p.relative_to(tmp_path) for p in fresh}, "generated files without a .proto source"


def test_services_live_in_package_infermesh_v1():
    from protos.infermesh.v1 import inference_pb2, internal_pb2

    assert inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name == "infermesh.v1.Inference"
    assert {"Decode", "Prefill", "KVTransfer", "Admin"} <= set(internal_pb2.DESCRIPTOR.services_by_name)
    assert internal_pb2.KVTransport.Name(internal_pb2.KV_TRANSPORT_TORCH_P2P) == "KV_TRANSPORT_TORCH_P2P"
