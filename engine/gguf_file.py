"""A GGUF file's metadata and tensor table, read with `struct` from one memory map: what `gguf.GGUFReader`
gives (`fields[key].contents()`, `tensors`), in 0.15 s against its 4.0 s for SmolLM2's file. That reader
makes a numpy view for every part of every field, and SmolLM2's vocabulary and merges are ~98,000 strings:
~4 s of each process's start. The tensor data stays in the map until dequantized
(`engine.gguf_dequant`).

    metadata, tensors = read_gguf(path)   # ValueError naming what is wrong with a file that is not GGUF

Little-endian GGUF versions 2 and 3 (what llama.cpp writes); a tensor's `data` is a numpy view of the file,
shaped as `GGUFReader` shapes it: the dims reversed, and for quantized types a byte array per row.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_PLAIN_TYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # a read-only view of the file


def read_gguf(path: str | Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata key -> value, tensors in file order) of the GGUF file at `path`."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # lives as long as a tensor views it
    reader = _Reader(data)
    if reader.take(4) != MAGIC:
        raise ValueError("not a GGUF file (no GGUF magic)")
    version, tensor_count, kv_count = reader.unpack("<IQQ")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not one of {VERSIONS} (or the file is big-endian)")
    metadata = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(GGUFValueType(reader.unpack("<I")[0]))
    table = []
    for _ in range(tensor_count):
        name = reader.string()
        (n_dims,) = reader.unpack("<I")
        dims = reader.unpack(f"<{n_dims}Q")
        kind, offset = reader.unpack("<IQ")
        table.append((name, dims, GGMLQuantizationType(kind), offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
    start = -(-reader.pos // alignment) * alignment
    tensors, names = [], set()
    buffer = np.frombuffer(data, dtype=np.uint8)
    for name, dims, kind, offset in table:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        if kind not in GGML_QUANT_SIZES:
            raise ValueError(f"tensor {name!r} has type {kind.name}, which has no known size")
        shape, elements = tuple(reversed(dims)), int(np.prod(dims))
        block, block_bytes = GGML_QUANT_SIZES[kind]
        nbytes = elements * block_bytes // block
        if start + offset + nbytes > len(data):
            raise ValueError(f"tensor {name!r} runs past the end of the file ({start + offset + nbytes} > {len(data)})")
        raw = buffer[start + offset:start + offset + nbytes]
        if kind in _PLAIN_TYPES:
            array = raw.view(_PLAIN_TYPES[kind]).reshape(shape)
        else:
            array = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, array))
    return metadata, tensors


class _Reader:
    """Values read in order from `data`, little-endian; ValueError where the file ends first."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError(f"GGUF file truncated: {n} bytes wanted at byte {self.pos} of {len(self.data)}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ValueError(f"GGUF file truncated: {size} bytes wanted at byte {self.pos} of {len(self.data)}")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        return self.take(n).decode("utf-8")

    def value(self, kind: GGUFValueType):
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = self.unpack("<IQ")
            item = GGUFValueType(item)
            if item in _SCALARS:  # one unpack for the whole array
                return list(self.unpack(f"<{count}{_SCALARS[item]}"))
            return [self.value(item) for _ in range(count)]
        return self.unpack("<" + _SCALARS[kind])[0]
