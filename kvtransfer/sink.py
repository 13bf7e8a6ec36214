"""The engine's KV sink for one request: cut each finished layer by the plan and hand the pieces to senders.

`PlanSink` is what a prefill instance passes to `EngineCore.add_request(kv_sink=...)`.
It never raises into the engine step: a destination that fails is skipped from
then on and `finish` raises its TransferError.
on the first layer it learns the prompt's blocks and computes the plan to the
decode layout; every layer, it copies this rank's pieces out of the cache (the
head range of each destination rank) and sends them; `finish` waits for every
destination's acknowledgement.
"""

from __future__ import annotations

import torch

from kvtransfer.plan import DecodeLayout, Piece, PrefillLayout, plan
from kvtransfer.transport import KVSender, TransferError, TransferStats


class PlanSink:
    def __init__(self, *, num_tokens: int, num_kv_heads: int, block_size: int, target: DecodeLayout,
                 senders: list[KVSender], src_rank: int = 0, token_ranges=None) -> None:
        self.num_tokens, self.num_kv_heads, self.block_size = num_tokens, num_kv_heads, block_size
        self.target, self.senders, self.src_rank = target, senders, src_rank
        self.token_ranges = token_ranges or (((0, num_tokens),),)  # a single prefill rank holds every token
        self.pieces: tuple[Piece, ...] | None = None

    def push_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: list[int]) -> None:
        if self.pieces is None:
            source = PrefillLayout(token_ranges=self.token_ranges, num_kv_heads=self.num_kv_heads,
                                   block_size=self.block_size, block_table=tuple(block_table[: -(-self.num_tokens // self.block_size)]))
            self.pieces = tuple(p for p in plan(source, self.target) if p.src_rank == self.src_rank)
        keys_all = k_cache.view(-1, *k_cache.shape[2:])  # [slots, heads, head_dim]
        values_all = v_cache.view(-1, *v_cache.shape[2:])
        for piece in self.pieces:
            rows, heads = slice(piece.src_slot, piece.src_slot + piece.num_tokens), slice(*piece.heads)
            self.senders[piece.dst_rank].send(layer, piece, keys_all[rows, heads].clone(), values_all[rows, heads].clone())
        for sender in self.senders:
            try:
                sender.flush()
            except TransferError:
                pass  # the sender is FAILED now; finish() raises it

    def finish(self, timeout_s: float = 60.0) -> TransferStats:
        """Wait for every destination; raises TransferError if any failed (after finishing the others)."""
        results, error = [], None
        for sender in self.senders:
            try:
                results.append(sender.finish(timeout_s))
            except Exception as e:  # keep finishing the rest so no stream is left open
                error = error or e
        if error is not None:
            raise error
        return TransferStats(sum(r.bytes for r in results), sum(r.pieces for r in results),
                             max((r.seconds for r in results), default=0.0))
