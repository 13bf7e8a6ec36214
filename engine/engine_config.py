"""How one engine instance runs (dtype, device, KV cache, batching, weights): where these settings are declared.

Plain Python, no torch at import: the services' settings (`mesh.settings`), `infermesh up` and the CLI take
their defaults from here, so each is declared once. `from_settings` reads the same-named fields of a service's
settings object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import check_quantization

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    dtype: str = "bfloat16"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # per rank: a context-parallel instance of N ranks holds N times this
    num_kv_blocks: int | None = None  # per rank; overrides kv_cache_bytes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # tokens an engine step takes: prompt chunks and decode rows
    max_model_len: int | None = None  # default: the model's context
    seed: int | None = None  # for requests without a seed of their own
    quantization: str = "none"  # or int8: weight-only, for low-latency decode at few streams (engine/quantize.py)
    # False: float32 CPU decode through infermesh's few-row kernel (1-8 rows), faster, its rows matching each
    # other in any such batch but not what torch's GEMM gives larger ones. bf16 and fp16 take the kernel either
    # way: up to 64 rows, invariant (engine/model.py, Linear). int8 weights on AMX: 2-64 rows on AMX tiles,
    # a row alone on the dot path (engine/quantize.py)
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        check_quantization(self.quantization)

    @property
    def torch_dtype(self):
        """The torch dtype (torch is imported here, on first use: the settings never need it)."""
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def from_settings(cls, settings) -> "EngineConfig":
        """The fields of a service's settings that an EngineConfig has (they share the names)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name in names})


DEFAULTS = EngineConfig()
