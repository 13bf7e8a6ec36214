"""`engine.gguf_file` reads what the `gguf` package's reader reads, and `engine.gguf_dequant` dequantizes to
the bits `gguf.quants` gives (a reference we did not write): every metadata value type and the tensor types
SmolLM2's file uses, written by `gguf.GGUFWriter` and in SmolLM2's own file; a file that is not whole GGUF is
refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.gguf_dequant import dequantize
from engine.gguf_file import read_gguf
from engine.model_info import resolve_model


def same_as_the_gguf_package(path) -> None:
    """Metadata, tensor views and dequantized values alike."""
    metadata, tensors = read_gguf(path)
    reference = gguf.GGUFReader(str(path))
    assert metadata == {key: field.contents() for key, field in reference.fields.items()
                        if not key.startswith("GGUF.")}  # the reader's own entries: version and counts
    assert [(t.name, t.tensor_type) for t in tensors] == [(t.name, t.tensor_type) for t in reference.tensors]
    for ours, theirs in zip(tensors, reference.tensors):
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data, equal_nan=True)
        values, expected = dequantize(ours), gguf.quants.dequantize(theirs.data, theirs.tensor_type)
        assert values.dtype == expected.dtype == np.float32 and values.shape == expected.shape
        assert values.tobytes() == expected.tobytes()  # bit for bit


def test_every_value_type_and_tensor_type_reads_as_the_gguf_package_reads_it(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_custom_alignment(64)
    for i, (kind, value) in enumerate([(writer.add_uint8, 200), (writer.add_int8, -100), (writer.add_uint16, 60000),
                                       (writer.add_int16, -30000), (writer.add_uint32, 4_000_000_000),
                                       (writer.add_int32, -2_000_000_000), (writer.add_float32, 0.1),
                                       (writer.add_uint64, 2**63 + 5), (writer.add_int64, -(2**62)),
                                       (writer.add_float64, 0.1), (writer.add_bool, True),
                                       (writer.add_string, "héllo ✓")]):
        kind(f"test.scalar{i}", value)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.strings", ["a", "", "ü" * 300])
    writer.add_array("test.empty", [])
    g = np.random.default_rng(3)
    weights = g.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("f32", weights)
    writer.add_tensor("f16", weights.astype(np.float16))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        writer.add_tensor(qtype.name.lower(), gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.add_tensor("vector", g.standard_normal(5).astype(np.float32))  # odd bytes: the next is padded
    writer.add_tensor("cube", g.standard_normal((2, 3, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    same_as_the_gguf_package(path)
    metadata, tensors = read_gguf(path)
    assert metadata["test.scalar11"] == "héllo ✓" and metadata["test.scalar6"] == np.float32(0.1)
    assert metadata["test.strings"] == ["a", "", "ü" * 300] and metadata["general.alignment"] == 64
    assert np.array_equal(tensors[0].data, weights) and not tensors[0].data.flags.writeable  # a view of the file


def test_smollm2s_file_reads_as_the_gguf_package_reads_it():
    same_as_the_gguf_package(resolve_model("smollm2-135m"))


def test_a_file_that_is_not_whole_gguf_is_refused_by_name(tmp_path):
    whole = resolve_model("smollm2-135m").read_bytes()[:2_000_000]  # the header and the first tensors
    header_end = 1_700_000  # inside the vocabulary's strings
    cases = [(b"", "cannot mmap an empty file"), (b"PK\x03\x04" + whole[4:], "not a GGUF file"),
             (whole[:4] + (9).to_bytes(4, "little") + whole[8:], "GGUF version 9 is not one of"),
             (whole[:header_end], "GGUF file truncated"),
             (whole[:24] + (1 << 40).to_bytes(8, "little") + whole[32:], "GGUF file truncated"),  # a key's length
             (whole, "runs past the end of the file")]
    for i, (data, error) in enumerate(cases):
        path = tmp_path / f"bad{i}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=error):
            read_gguf(path)
