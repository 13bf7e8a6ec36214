"""A whole mesh in this process, for the tests of its behaviour: a prefill, a decode and a router instance over
one in-memory registry, on a tiny checkpoint in float32 (`engine` reference outputs are exact)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from decode_svc.server import DecodeInstance
from mesh.registry import MemoryRegistry
from mesh.settings import DecodeSettings, PrefillSettings, RouterSettings
from prefill_svc.server import PrefillInstance
from router.server import RouterInstance
from tests.helpers import wait_until


@dataclass(frozen=True)
class TinyMesh:
    router: RouterInstance
    prefill: PrefillInstance
    decode: DecodeInstance
    registry: MemoryRegistry
    model: str  # the checkpoint's folder


@contextlib.contextmanager
def tiny_mesh(folder, **router_settings):
    """The three instances, once the router's registry lists them; stopped on exit. `router_settings`: the
    router's (e.g. local_prefill_max_tokens, http_port)."""
    registry = MemoryRegistry()
    common = dict(model=str(folder), dtype="float32", kv_cache_bytes=1 << 22, block_size=16)
    prefill = PrefillInstance(PrefillSettings(**common), registry=registry)
    decode = DecodeInstance(DecodeSettings(**common), registry=registry)
    router = RouterInstance(RouterSettings(model=str(folder), **router_settings), registry=registry)
    try:
        wait_until(lambda: len(registry.instances()) == 3)
        yield TinyMesh(router, prefill, decode, registry, str(folder))
    finally:
        for instance in (router, prefill, decode):
            instance.stop()
