"""The Redis registry: for a mesh across hosts. Records are keys with a TTL, so a crashed instance
disappears on its own.

Keys (prefix `infermesh:`): `instance:<id>` holds the record as JSON with a
millisecond TTL; `instances` is a set of ids (members whose record expired are
skipped and pruned); `blocks:<id>` is the set of block hashes, with the same TTL.
"""

from __future__ import annotations

import redis

from mesh.registry.base import InstanceInfo, Registry, Role

PREFIX = "infermesh:"
# Drop ids whose record has expired, unless it was re-registered meanwhile (atomic on the server).
PRUNE = """
for _, id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[1] .. 'instance:' .. id) == 0 then redis.call('SREM', KEYS[1] .. 'instances', id) end
end
"""


class RedisRegistry(Registry):
    def __init__(self, url: str) -> None:
        self.url = url
        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._prune = self._redis.register_script(PRUNE)

    def register(self, info: InstanceInfo, ttl_s: float) -> None:
        with self._redis.pipeline() as pipe:
            pipe.set(f"{PREFIX}instance:{info.id}", info.to_json(), px=_ms(ttl_s))
            pipe.sadd(f"{PREFIX}instances", info.id)
            pipe.pexpire(f"{PREFIX}blocks:{info.id}", _ms(ttl_s))
            pipe.execute()

    def deregister(self, instance_id: str) -> None:
        with self._redis.pipeline() as pipe:
            pipe.delete(f"{PREFIX}instance:{instance_id}", f"{PREFIX}blocks:{instance_id}")
            pipe.srem(f"{PREFIX}instances", instance_id)
            pipe.execute()

    def instances(self, role: Role | None = None) -> list[InstanceInfo]:
        live = self._live()
        return [info for _, info in sorted(live.items()) if role in (None, info.role)]

    def set_block_hashes(self, instance_id: str, hashes: set[int], ttl_s: float) -> None:
        key = f"{PREFIX}blocks:{instance_id}"
        with self._redis.pipeline() as pipe:  # MULTI/EXEC: readers never see a half-replaced set
            pipe.delete(key)
            if hashes:
                pipe.sadd(key, *(str(h) for h in hashes))
                pipe.pexpire(key, _ms(ttl_s))
            pipe.execute()

    def prefix_hits(self, chain: list[int]) -> dict[str, int]:
        return self._hits(sorted(self._live()), chain)

    def snapshot(self) -> tuple[list[InstanceInfo], dict[str, frozenset[int]]]:
        live = self._live()
        ids = sorted(live)
        with self._redis.pipeline(transaction=False) as pipe:
            for iid in ids:
                pipe.smembers(f"{PREFIX}blocks:{iid}")
            held = pipe.execute() if ids else []
        return [live[i] for i in ids], {i: frozenset(int(h) for h in hashes) for i, hashes in zip(ids, held)}

    def _hits(self, ids: list[str], chain: list[int]) -> dict[str, int]:
        if not chain:
            return {iid: 0 for iid in ids}
        with self._redis.pipeline(transaction=False) as pipe:
            for iid in ids:
                pipe.smismember(f"{PREFIX}blocks:{iid}", [str(h) for h in chain])
            held = pipe.execute()
        return {iid: next((i for i, hit in enumerate(flags) if not hit), len(chain)) for iid, flags in zip(ids, held)}

    def close(self) -> None:
        self._redis.close()

    def _live(self) -> dict[str, InstanceInfo]:
        ids = sorted(m.decode() for m in self._redis.smembers(f"{PREFIX}instances"))
        records = self._redis.mget([f"{PREFIX}instance:{iid}" for iid in ids]) if ids else []
        expired = [iid for iid, record in zip(ids, records) if record is None]
        if expired:
            self._prune(keys=[PREFIX], args=expired)
        return {iid: InstanceInfo.from_json(record) for iid, record in zip(ids, records) if record is not None}


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
