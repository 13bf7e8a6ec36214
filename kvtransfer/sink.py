"""The engine's KV sink for one request on one prefill rank: cut each finished layer by the plan and
hand the pieces to senders (one per decode rank).

`PlanSink` is what a prefill instance passes to `EngineCore.add_request(kv_sink=...)`
(and what each other rank of a context-parallel instance builds for itself). On
the first layer it learns the prompt's blocks and which of them this rank stores
(its `KVStripe`), and plans this rank's pieces to the decode layout: the ranks'
stripes partition the prompt, so their plans together cover it exactly once.
Every layer it copies each destination rank's pieces out of the cache at once
(one gather of their rows and the rank's head range, into the sender's own
memory when it has some: `KVSender.layer_buffers`; no copy at all when they are
one range of the cache) and sends them; after the step's last layer it waits
until no sender reads the cache any more (`KVSender.settle`: the blocks may be
reused once the step ends); `finish` waits for every destination's
acknowledgement. It never raises into the engine step: a destination that fails
is skipped from then on and `finish` raises its TransferError.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVStripe
from engine.parallel.cp_shard import stripe_runs
from kvtransfer.plan import DecodeLayout, Piece, PrefillLayout, plan
from kvtransfer.transport import KVSender, TransferError, TransferStats, gather_rows, merge_runs


class PlanSink:
    def __init__(self, *, num_tokens: int, num_kv_heads: int, block_size: int, num_layers: int, target: DecodeLayout,
                 senders: list[KVSender]) -> None:
        self.num_tokens, self.num_kv_heads, self.block_size = num_tokens, num_kv_heads, block_size
        self.last_layer = num_layers - 1
        self.target, self.senders = target, senders
        self.pieces: tuple[Piece, ...] | None = None
        self.by_rank: dict[int, tuple[list[tuple[int, int]], slice, list[tuple[int, int]]]] = {}
        self.rows: dict[int, slice | None] = {}  # per destination rank: its rows as one range of the cache
        self.error: TransferError | None = None  # the plan could not be made: nothing is sent

    def push_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: tuple[int, ...],
                   stripe: KVStripe) -> None:
        keys_all = k_cache.view(-1, *k_cache.shape[2:])  # [slots, heads, head_dim]
        values_all = v_cache.view(-1, *v_cache.shape[2:])
        if self.pieces is None:
            for sender in self.senders:
                sender.open(self.last_layer)  # each layer goes with the same runs
            table = tuple(block_table[: -(-self.num_tokens // self.block_size)])
            runs = stripe_runs(table, 0, self.num_tokens, self.block_size, stripe.size)[stripe.rank]
            try:  # this rank's tokens, addressed in its own cache (a foreign block's local id is never read)
                source = PrefillLayout(token_ranges=(tuple(runs),), num_kv_heads=self.num_kv_heads,
                                       block_size=self.block_size, block_table=tuple(map(stripe.local, table)))
                self.pieces = plan(source, self.target)
            except ValueError as e:
                self.pieces, self.error = (), TransferError(f"no transfer plan: {e}")
            self.by_rank = by_destination(self.pieces)
            self.rows = {dst_rank: in_place(keys_all[:, heads], source_runs)
                         for dst_rank, (source_runs, heads, _) in self.by_rank.items()}
        for dst_rank, (source_runs, heads, runs) in self.by_rank.items():  # one gather per destination rank
            sender, rows = self.senders[dst_rank], self.rows[dst_rank]
            if rows is not None:  # one range of the cache: sent as it lies
                keys, values = keys_all[rows, heads], values_all[rows, heads]
            else:  # gathered: into the sender's own memory when it has some
                shape = (sum(n for _, n in source_runs), heads.stop - heads.start, keys_all.shape[-1])
                keys_out, values_out = sender.layer_buffers(shape, keys_all.dtype, keys_all.device) or (None, None)
                keys = gather_rows(keys_all[:, heads], source_runs, keys_out)  # [sum(tokens), its heads, D]
                values = gather_rows(values_all[:, heads], source_runs, values_out)
            sender.send_runs(layer, runs, keys, values)
        for sender in self.senders:
            try:
                sender.flush()
            except TransferError:
                pass  # the sender is FAILED now; finish() raises it
        if layer == self.last_layer:
            for sender in self.senders:
                sender.settle()

    def finish(self, timeout_s: float = 60.0) -> TransferStats:
        """Wait for every destination; raises TransferError if any failed (after finishing the others)."""
        results, error = [], self.error
        for sender in self.senders:
            try:
                results.append(sender.finish(timeout_s))
            except Exception as e:  # keep finishing the rest so no stream is left open
                error = error or e
        if error is not None:
            raise error
        return TransferStats(sum(r.bytes for r in results), sum(r.pieces for r in results),
                             max((r.seconds for r in results), default=0.0))


def in_place(src: torch.Tensor, runs: list[tuple[int, int]]) -> slice | None:
    """The rows of `runs` as a slice of `src` [slots, heads, D] when they are one contiguous range of it (of
    every layer's cache alike), else None."""
    ranges = merge_runs(runs)
    if len(ranges) != 1:
        return None
    (slot, n), = ranges
    return slice(slot, slot + n) if src[slot:slot + n].is_contiguous() else None


def by_destination(pieces: tuple[Piece, ...]) -> dict[int, tuple[list[tuple[int, int]], slice, list[tuple[int, int]]]]:
    """Per destination rank, what each layer sends it: (source runs of (first slot, tokens); its heads;
    destination runs), in the order of the plan, runs merged where they continue one another."""
    grouped: dict[int, list[Piece]] = {}
    for piece in pieces:
        grouped.setdefault(piece.dst_rank, []).append(piece)
    by_rank = {}
    for dst_rank, mine in grouped.items():
        (heads,) = {p.heads for p in mine}  # a destination rank stores one head range
        by_rank[dst_rank] = (merge_runs([(p.src_slot, p.num_tokens) for p in mine]), slice(*heads),
                             merge_runs([(p.dst_slot, p.num_tokens) for p in mine]))
    return by_rank
