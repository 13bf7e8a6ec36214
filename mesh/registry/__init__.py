"""Where the mesh's instances find each other: one interface, an in-memory and a Redis implementation."""

from mesh.registry.base import InstanceInfo, InstanceState, Registry, Role
from mesh.registry.memory import MemoryRegistry

__all__ = ["InstanceInfo", "InstanceState", "Registry", "Role", "MemoryRegistry", "connect_registry"]


def connect_registry(spec: str) -> Registry:
    """`memory` (this process only), `redis://HOST:PORT[/DB]`, or `grpc://HOST:PORT` (a served memory registry)."""
    if spec == "memory":
        return MemoryRegistry()
    if spec.startswith("grpc://"):
        from mesh.registry.remote import GrpcRegistry

        return GrpcRegistry(spec.removeprefix("grpc://"))
    if spec.startswith("redis://"):
        from mesh.registry.redis import RedisRegistry

        return RedisRegistry(spec)
    raise ValueError(f"registry must be 'memory', 'redis://HOST:PORT' or 'grpc://HOST:PORT', got {spec!r}")
