"""A KV pool in Mooncake Store, shared by every engine that names its master (`--kv-pool mooncake://HOST:PORT`):
the `engine.kv_tier.KVPool` an engine of one rank stores full blocks to and loads prompts' blocks from.

One object per block: every layer's keys then values for the block's `block_size` tokens, under a key that
names everything that makes KV reusable (`PoolIdentity`: the model and a fingerprint of its weights, the
dtype, the quantization, the block size, the rank layout) and the block's prefix chain hash, so a key can
never return KV computed under other conditions. The pool's memory is what Mooncake's clients contribute
(a `mooncake_client`, or any process that mounts a segment); an engine contributes none, so its blocks
outlive it.

A cache, never a source of truth: a lookup or a load that fails or outlasts `timeout_s` (the master down,
an entry evicted or torn mid-read) loads nothing and the engine computes the tokens; the error is counted
(`errors`) and logged once. Loads land in staging first and reach the cache only when whole, so a late
read never writes into blocks the engine may have reused. Stores copy the blocks on the engine thread (they
may be reused after the step) and are written by a background thread, dropped when it falls behind.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 10.0  # for the queued writes, at close
QUEUED_STORES = 64  # batches of blocks waiting to be written; past them a batch is dropped (counted)


@dataclass(frozen=True, slots=True)
class PoolIdentity:
    model: str  # the model's name and a fingerprint of its weights (`weights_fingerprint`)
    dtype: str
    quantization: str
    block_size: int
    layout: str  # which ranks and heads the KV belongs to, e.g. "tp1/0"

    @classmethod
    def of(cls, checkpoint, config, layout: str = "tp1/0") -> "PoolIdentity":
        """Of an engine of `checkpoint` (engine.weights.Checkpoint) run with `config` (EngineConfig)."""
        return cls(f"{checkpoint.source.name}-{weights_fingerprint(checkpoint.weights)}", config.dtype,
                   config.quantization, config.block_size, layout)

    def key(self, block_hash: int) -> str:
        return f"infermesh/{self.model}/{self.dtype}/{self.quantization}/b{self.block_size}/{self.layout}/" \
               f"{block_hash:016x}"


def weights_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A short hash of every weight's name, shape and dtype, and of the bytes of up to four tensors (the
    first, the last and two between): checkpoints that differ in any of them get other keys."""
    names = sorted(state)
    h = hashlib.blake2b(digest_size=8)
    for name in names:
        t = state[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    for name in sorted({names[0], names[len(names) // 3], names[2 * len(names) // 3], names[-1]}) if names else ():
        h.update(state[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def attach(master: str | None, checkpoint, config, host: str, timeout_s: float):
    """The `kv_pool` argument of an EngineCore of `checkpoint` and `config` (EngineConfig) on one rank, for
    the pool whose master is at `master` (HOST:PORT; None: no pool)."""
    if master is None:
        return None
    identity = PoolIdentity.of(checkpoint, config)
    return lambda kv_cache: MooncakePool(master, kv_cache, identity, host, timeout_s)


class MooncakePool:
    """One engine's client of the pool: `lookup`, `load`, `store` (engine.kv_tier.KVPool)."""

    def __init__(self, master: str, kv_cache: list[tuple[torch.Tensor, torch.Tensor]], identity: PoolIdentity,
                 host: str = "127.0.0.1", timeout_s: float = 2.0) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        from mooncake.store import MooncakeDistributedStore  # the optional dependency: infermesh[mooncake]

        self.kv_cache, self.identity, self.timeout_s = kv_cache, identity, timeout_s
        k = kv_cache[0][0]
        self.block_bytes = 2 * len(kv_cache) * k[0].numel() * k.element_size()  # one block, every layer
        self.errors = self.dropped = 0
        self.on_lookup: Callable[[float], None] = lambda seconds: None  # each lookup's seconds (a histogram's)
        self._store = MooncakeDistributedStore()
        if self._store.setup(host, "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master) != 0:
            raise ConnectionError(f"cannot reach the KV pool's master at {master}")
        self._calls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-pool")  # bounded waits
        self._writes: queue.Queue = queue.Queue(QUEUED_STORES)
        self._logged = False
        self._writer = threading.Thread(target=self._write_forever, name="kv-pool-writer", daemon=True)
        self._writer.start()
        atexit.register(self.close)  # Mooncake's client aborts the process if destroyed unclosed

    def lookup(self, hashes: Sequence[int]) -> int:
        start = time.perf_counter()
        found = self._call(self._store.batch_is_exist, [self.identity.key(h) for h in hashes])
        self.on_lookup(time.perf_counter() - start)
        held = next((i for i, hit in enumerate(found) if hit != 1), len(found))
        if held < len(found) and found[held] < 0:  # 1: there, 0: not there, below: the store could not say
            self._failed(f"looking blocks up failed ({found[held]})")
        return held

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> int:
        staging = torch.empty(len(hashes), self.block_bytes, dtype=torch.uint8)
        sizes = self._call(self._store.batch_get_into, [self.identity.key(h) for h in hashes],
                           [staging[i].data_ptr() for i in range(len(hashes))], [self.block_bytes] * len(hashes),
                           keep=staging)
        whole = next((i for i, n in enumerate(sizes) if n != self.block_bytes), len(sizes)) if sizes else 0
        if sizes and whole < len(hashes):
            self._failed(f"{len(hashes) - whole} of {len(hashes)} blocks did not load whole ({sizes[whole]})")
        if whole:
            rows = self._layers(staging[:whole])
            index = torch.tensor(list(blocks[:whole]), device=self.kv_cache[0][0].device)
            for (k, v), (k_rows, v_rows) in zip(self.kv_cache, rows):
                k.index_copy_(0, index, k_rows.to(k.device))
                v.index_copy_(0, index, v_rows.to(v.device))
        return whole

    def store(self, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        index = torch.tensor(list(blocks), device=self.kv_cache[0][0].device)
        staging = torch.empty(len(hashes), self.block_bytes, dtype=torch.uint8)
        for (k, v), (k_rows, v_rows) in zip(self.kv_cache, self._layers(staging)):
            k_rows.copy_(k.index_select(0, index))
            v_rows.copy_(v.index_select(0, index))
        try:
            self._writes.put_nowait(([self.identity.key(h) for h in hashes], staging))
        except queue.Full:
            self.dropped += len(hashes)
            self._failed(f"the writer fell {QUEUED_STORES} batches behind: {len(hashes)} blocks not stored")

    def close(self) -> None:
        """Write what is queued, then leave the pool (idempotent)."""
        atexit.unregister(self.close)
        if self._writer.is_alive():
            self._writes.put(None)
            self._writer.join(CLOSE_WAIT_S)
        self._calls.shutdown(wait=False, cancel_futures=True)
        if not self._writer.is_alive():  # else a write hangs in the client: closing it under the write would crash
            self._store.close()

    def _layers(self, staging: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of staging [n, block_bytes] as each layer's keys and values of n blocks."""
        k = self.kv_cache[0][0]
        typed = staging.view(k.dtype).view(len(staging), len(self.kv_cache), 2, *k.shape[1:])
        return [(typed[:, layer, 0], typed[:, layer, 1]) for layer in range(len(self.kv_cache))]

    def _write_forever(self) -> None:
        while (item := self._writes.get()) is not None:
            keys, staging = item
            try:
                results = self._store.batch_put_from(keys, [staging[i].data_ptr() for i in range(len(keys))],
                                                     [self.block_bytes] * len(keys))
                if any(r != 0 for r in results):
                    self._failed(f"storing {sum(r != 0 for r in results)} of {len(keys)} blocks failed")
            except Exception as e:  # noqa: BLE001 - the pool is a cache: count it and go on
                self._failed(f"storing blocks failed: {e!r}")

    def _call(self, method, *args, keep: torch.Tensor | None = None) -> list[int]:
        """`method(*args)` within `timeout_s`; [] when it fails or is late (counted). `keep`: memory the call
        writes into, kept alive until it returns, however late."""
        future = self._calls.submit(method, *args)
        future.add_done_callback(lambda _, kept=keep: kept)
        try:
            return list(future.result(self.timeout_s))
        except concurrent.futures.TimeoutError:
            self._failed(f"{method.__name__} took longer than {self.timeout_s} s")
        except Exception as e:  # noqa: BLE001
            self._failed(f"{method.__name__} failed: {e!r}")
        return []

    def _failed(self, why: str) -> None:
        self.errors += 1
        if not self._logged:
            self._logged = True
            log.warning("KV pool: %s; the engine computes what it could not load (logged once, counted after)", why)
