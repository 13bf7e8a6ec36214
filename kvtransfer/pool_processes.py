"""The processes of a KV pool on one host (what `infermesh up --kv-pool mooncake` starts): Mooncake Store's
master, and a client that gives the pool its memory (engines give none, so blocks outlive them). Plain
Python: their command lines; the supervisor runs them.

Both bind `host` for their RPC ports; Mooncake's transfer listeners bind every interface (README, Security).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def binary(name: str) -> str:
    """A program of the mooncake wheel, beside this Python's or on PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed: pip install 'infermesh[mooncake]'")
    return found


def master(host: str, port: int, metrics_port: int) -> list[str]:
    return [binary("mooncake_master"), "-rpc_address", host, "-rpc_port", str(port), "-metrics_host", host,
            "-metrics_port", str(metrics_port)]


def memory(host: str, port: int, master_port: int, size: str) -> list[str]:
    """A client holding `size` (e.g. "4 GB") of the pool's memory."""
    return [binary("mooncake_client"), "-host", host, "-port", str(port), "-master_server_address",
            f"{host}:{master_port}", "-metadata_server", "P2PHANDSHAKE", "-global_segment_size", size]
