"""The engine's side of a KV tier below its cache (a pool shared across instances): what to look up, load
and store, and when. Pure Python: no torch; the pool moves the bytes (`KVPool`, e.g. `kvtransfer.kv_pool`).

Before a step is scheduled, each newly waiting sequence's full prompt blocks that the engine's own prefix
cache lacks are looked up in the pool; the longest run it holds is loaded into fresh blocks, which join the
prefix cache under their chain hashes and go back to the free list (most recently freed: evicted last).
The scheduler then finds them as it finds any cached prefix, and the engine computes only the rest.
After a step, each sequence's blocks that became full are handed to the pool to store (it copies them
before the step ends and writes them in the background); a reserved sequence's pushed prompt blocks are
left to the instance that computed them.

The pool is a cache, never a source of truth: a pool that fails, is slow or lost an entry loads fewer
blocks (or none), and the engine computes them.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

from engine.block_manager import BlockManager, prefix_hashes
from engine.sequence import Sequence as Seq


class KVPool(Protocol):
    def lookup(self, hashes: Sequence[int]) -> int:
        """How many of the leading `hashes` the pool holds."""

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> int:
        """Copy those blocks' KV into the cache's `blocks`; how many of the leading ones arrived whole."""

    def store(self, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        """Keep the KV of full `blocks` under their `hashes` (read before the step's blocks may be reused)."""


class KVTier:
    def __init__(self, pool: KVPool, blocks: BlockManager) -> None:
        self.pool, self.blocks = pool, blocks
        self.loaded_tokens = self.stored_tokens = 0
        self._stored: dict[str, int] = {}  # request id -> its leading blocks the pool has (or was given)

    def before_schedule(self, waiting: Iterable[Seq]) -> None:
        for seq in waiting:
            if seq.request_id not in self._stored:
                self._stored[seq.request_id] = self._load(seq.token_ids)

    def _load(self, token_ids: list[int]) -> int:
        """Load what the pool holds past the local prefix cache; the blocks of the prompt now cached here."""
        bs = self.blocks.block_size
        hashes = prefix_hashes(token_ids[: (len(token_ids) - 1) // bs * bs], bs)  # as match_prefix: one left
        local = next((i for i, h in enumerate(hashes) if h not in self.blocks.cached), len(hashes))
        wanted = hashes[local:]
        if not wanted:
            return local
        held = self.pool.lookup(wanted)
        table: list[int] = []
        if not held or not self.blocks.grow(table, held * bs):
            return local
        loaded = self.pool.load(wanted[:held], table)
        self.blocks.adopt(table[:loaded], wanted[:loaded])
        self.blocks.free(table)
        self.loaded_tokens += loaded * bs
        return local + loaded

    def after_update(self, seqs: Iterable[Seq]) -> None:
        for seq in seqs:  # one never seen waiting was reserved: its prompt's blocks came from the instance that
            # computed them, which stored them
            done = self._stored.setdefault(seq.request_id, seq.num_prompt_tokens // self.blocks.block_size)
            new = seq.block_hashes[done:]
            if new:
                self.pool.store(new, seq.block_table[done:len(seq.block_hashes)])
                self._stored[seq.request_id] = len(seq.block_hashes)
                self.stored_tokens += len(new) * self.blocks.block_size

    def forget(self, request_id: str) -> None:
        self._stored.pop(request_id, None)
