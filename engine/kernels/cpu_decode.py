"""Paged decode attention on CPU, a C++ kernel (`cpu_paged_decode.cpp`) built on first use.

    out = paged_decode(q [B, Hq, D], k_cache, v_cache [blocks, block_size, Hkv, D],
                       block_tables [B, max_blocks], context_lens [B], scale, kv_head_map=None)  # [B, Hq, D]

It reads each sequence's keys and values straight from its blocks (no gather of the context every
layer), each cache row once for all the query heads that share it, with float32 scores and sums, on
torch's intra-op threads. The result of a sequence does not depend on its batch or the thread count.

The kernel is compiled for this machine's CPU with torch's cpp_extension (g++ and ninja; ~15 s once,
then cached under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR). `available()` says whether it
could be built; where it cannot, the engine attends with torch (a gather and SDPA) and logs why once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


@functools.cache
def _ops():
    from torch.utils import cpp_extension

    source = SOURCE.read_bytes()
    # -march=native: the build is for this CPU, so its cache entry is named by the CPU's flags as well
    key = hashlib.sha256(source + _cpu_flags().encode() + torch.__version__.encode()).hexdigest()[:16]
    # OpenMP: at::parallel_for then runs on torch's own thread pool (the same libgomp, found by its soname)
    flags = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
    if platform.machine() == "x86_64":
        flags.append("-mprefer-vector-width=512")  # where AVX-512 is, use all of it (gcc defaults to 256 bits)
    cpp_extension.load(name=f"infermesh_cpu_decode_{key}", sources=[str(SOURCE)], is_python_module=False,
                       extra_cflags=flags, extra_ldflags=["-fopenmp"])
    return torch.ops.infermesh_cpu


@functools.cache
def available() -> bool:
    """Whether the kernel is built (building it now if need be)."""
    try:
        _ops()
        return True
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: attend with torch instead
        log.warning("CPU decode attention kernel not built (%s); decode attends with torch's SDPA instead",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, kv_head_map: torch.Tensor | None = None) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit queries "
                         f"{tuple(q.shape)}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"query {q.dtype} and caches {k_cache.dtype} / {v_cache.dtype} must share a dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must have {batch} rows")
    if kv_head_map is None:
        if num_heads % num_kv_heads:
            raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
        kv_head_map = _groups(num_heads, num_kv_heads)
    elif kv_head_map.shape != (num_heads,) or not 0 <= kv_head_map.min() <= kv_head_map.max() < num_kv_heads:
        raise ValueError(f"kv_head_map must give each of {num_heads} query heads a KV head in [0, {num_kv_heads})")
    return _ops().paged_decode(q.contiguous(), k_cache, v_cache, block_tables.long().contiguous(),
                               context_lens.int(), kv_head_map.long().contiguous(), scale)


@functools.cache
def _groups(num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Plain GQA: query head h reads KV head h // (Hq / Hkv)."""
    return torch.arange(num_heads) // (num_heads // num_kv_heads)


if __name__ == "__main__":  # `python -m engine.kernels.cpu_decode`: build it now (make setup does)
    raise SystemExit(0 if available() else 1)
