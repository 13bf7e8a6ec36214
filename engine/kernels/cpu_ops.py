"""The C++ CPU kernels (`engine/kernels/*.cpp`), built into one torch library, `torch.ops.infermesh_cpu`.

They are compiled for this machine's CPU with torch's cpp_extension on first use (g++ and ninja; ~20 s
once, then cached under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR, by a name that hashes the
sources, the CPU's flags and torch's version). `available()` says whether they could be built; where they
cannot, the engine computes with torch instead and logs why once. `python -m engine.kernels.cpu_ops`
builds them now (`make setup` does).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("cpu_*.cpp"))


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


@functools.cache
def ops():
    """torch.ops.infermesh_cpu, built if need be (raises where it cannot be)."""
    from torch.utils import cpp_extension

    code = b"".join(p.read_bytes() for p in SOURCES)
    # -march=native: the build is for this CPU, so its cache entry is named by the CPU's flags as well
    key = hashlib.sha256(code + _cpu_flags().encode() + torch.__version__.encode()).hexdigest()[:16]
    # OpenMP: at::parallel_for then runs on torch's own thread pool (the same libgomp, found by its soname)
    flags = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
    if platform.machine() == "x86_64":
        flags.append("-mprefer-vector-width=512")  # where AVX-512 is, use all of it (gcc defaults to 256 bits)
    cpp_extension.load(name=f"infermesh_cpu_{key}", sources=[str(p) for p in SOURCES], is_python_module=False,
                       extra_cflags=flags, extra_ldflags=["-fopenmp"])
    return torch.ops.infermesh_cpu


@functools.cache
def available() -> bool:
    """Whether the kernels are built (building them now if need be)."""
    try:
        ops()
        return True
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: compute with torch instead
        log.warning("CPU kernels not built (%s); the engine computes with torch instead",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


if __name__ == "__main__":
    raise SystemExit(0 if available() else 1)
