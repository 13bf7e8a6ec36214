"""The C++ CPU kernels (`engine/kernels/*.cpp`), built into one torch library, `torch.ops.infermesh_cpu`.

They are compiled for this machine's CPU with torch's cpp_extension on first use (g++ and ninja; ~20 s
once) into $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions)/<name>, where the name hashes the
sources, the CPU's flags and torch's version: a library found there is current, and later processes load
it straight away (no ninja run, no build lock to wait on; a process killed while holding torch's build
lock would otherwise stall every later load). `available()` says whether they could be built; where they
cannot, or where INFERMESH_CPU_KERNELS=off (a switch for operators: a CPU the build misjudges, a
comparison), the engine computes with torch instead and logs why once (INFERMESH_CPU_BF16=dot or fma
keeps the kernels but caps bf16's path: dot, AVX512-BF16 without AMX tiles; fma, float32 FMAs as on a CPU
with neither). `python -m engine.kernels.cpu_ops` builds them now (`make setup` does). `takes(*tensors)`
says whether they run on a set of inputs.

INFERMESH_CPU_MARCH (default `native`: this CPU) is the `-march` they are built for; e.g. `x86-64-v3`
(AVX2 and FMA, no AVX-512) builds the AVX2 paths on any newer x86 CPU, which is how the tests check them on
an AVX-512 machine. What each build may use is decided in one header (`cpu_features.h`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("cpu_*.cpp"))
HEADERS = sorted(HERE.glob("cpu_*.h"))
STALE_LOCK_S = 600  # a build lock older than this was left by a killed build


def _cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them (x86), or what the platform says its processor is."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def march() -> str:
    """The -march the kernels are built for: INFERMESH_CPU_MARCH, default native (this CPU)."""
    return os.environ.get("INFERMESH_CPU_MARCH", "native") or "native"


def library_path(root: str | Path | None = None) -> Path:
    """Where this machine's build of the kernels lies (built or not), under `root` or the default."""
    code = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    # -march=native builds for this CPU, so its name hashes the CPU's flags; a named target (a container image's
    # x86-64-v3) builds the same library anywhere, so a pod finds the one its image was built with
    target = (f"native {_cpu_flags()}" if march() == "native" else march()).encode()
    name = "infermesh_cpu_" + hashlib.sha256(code + target + torch.__version__.encode()).hexdigest()[:16]
    root = root or os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / name / f"{name}.so"


@functools.cache
def ops():
    """torch.ops.infermesh_cpu, built if need be (raises where it cannot be)."""
    library = library_path()
    if library.exists():
        try:
            torch.ops.load_library(str(library))
            return torch.ops.infermesh_cpu
        except OSError:  # a build killed while linking left it unfinished: build it again
            library.unlink(missing_ok=True)
    from torch.utils import cpp_extension

    build = library.parent
    build.mkdir(parents=True, exist_ok=True)
    lock = build / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    # OpenMP: the kernels' parallel regions run on torch's own thread pool (the same libgomp, by its soname)
    flags = ["-O3", f"-march={march()}", "-ffp-contract=fast", "-fopenmp"]
    if platform.machine() == "x86_64":
        flags.append("-mprefer-vector-width=512")  # where AVX-512 is, use all of it (gcc defaults to 256 bits)
    cpp_extension.load(name=library.stem, sources=[str(p) for p in SOURCES], build_directory=str(build),
                       is_python_module=False, extra_cflags=flags, extra_ldflags=["-fopenmp"])
    return torch.ops.infermesh_cpu


@functools.cache
def available() -> bool:
    """Whether the kernels are built (building them now if need be) and not switched off."""
    if os.environ.get("INFERMESH_CPU_KERNELS", "on").lower() in ("off", "0", "false"):
        log.warning("CPU kernels off (INFERMESH_CPU_KERNELS); the engine computes with torch instead")
        return False
    try:
        ops()
        return True
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: compute with torch instead
        log.warning("CPU kernels not built (%s); the engine computes with torch instead",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels run on these inputs: on the CPU, in one of their dtypes, and built. (Called for
    every layer of every step: a plain loop and `is_cpu`, 0.4 us against 1.4 with a generator over
    `device.type`.)"""
    dtype = tensors[0].dtype
    if dtype not in KERNEL_DTYPES:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype:
            return False
    return available()


if __name__ == "__main__":
    raise SystemExit(0 if available() else 1)
