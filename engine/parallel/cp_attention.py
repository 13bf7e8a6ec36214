"""Context-parallel attention over the paged KV cache: pass-KV and pass-Q ring attention, CP decode.

Every CP rank holds only its stripe of the instance's blocks (`KVStripe`: global
block g as local block g // N on rank g % N), so a sequence's KV is spread over
the ranks block by block, and every slot in this metadata is a local one. A rank
attends only over the blocks it holds and partial results merge exactly by
log-sum-exp:

- decode rows are replicated on every rank: each attends over its own slots, an
  all-gather brings every (O, LSE) and each rank merges them (pass-Q decode);
- a prefill span's new tokens are sharded. Pass-KV: each rank's KV (its cached
  prefix slots and its new tokens) travels the ring in N-1 steps, each send/recv
  posted before the attention on the block in hand so the two overlap. Pass-Q:
  the queries travel the ring instead, each rank attends the visiting queries to
  its own KV, and an all-to-all returns every partial (O, LSE) to the query's owner.

Prefill needs no masks: every block is laid out by runs of consecutive positions
(`Segment`s, computed once per step), and a query run attends a key run whole
when it comes earlier (or is the cached prefix), causally when it is the same
run, and not at all when it comes later — so each rank does exactly its share of
the causal work. Decode rows mask the unfilled tail of their blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import gather_blocks
from engine.parallel.cp_choice import CPChoice, CPMethod
from engine.parallel.cp_merge import attention_with_lse, merge_partials
from engine.parallel.cp_shard import Segment, Visibility, sees


@dataclass(frozen=True, slots=True)
class CPSpan:
    """One prefill chunk, as this rank sees it."""

    rows: slice  # this rank's new tokens in the flat batch (possibly empty)
    cached_slots: torch.Tensor  # [c] local slots of the cached prefix this rank holds
    choice: CPChoice
    query_layouts: tuple[tuple[Segment, ...], ...]  # per rank: its new tokens by run
    kv_layouts: tuple[tuple[Segment, ...], ...]  # per rank: its KV block (cached prefix, then new tokens)
    kv_len: int  # every rank's KV block padded to this (pass-KV)
    q_len: int  # every rank's query block padded to this (pass-Q)


@dataclass(frozen=True, slots=True)
class CPAttentionMetadata:
    group: object  # the CP process group
    write_rows: torch.Tensor  # [w] rows of the flat batch whose K/V this rank stores
    write_slots: torch.Tensor  # [w] local slots
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [B, W] the local blocks of each decode row held here, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, W * block_size] bool: a token in context
    spans: tuple[CPSpan, ...]


def context_parallel_attention(q, k, v, k_cache, v_cache, meta: CPAttentionMetadata, scale: float,
                               kv_head_map: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `paged_attention`: store this rank's K/V, attend; returns [T_local, Hq, D]."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    flat_k.index_copy_(0, meta.write_slots, k[meta.write_rows])
    flat_v.index_copy_(0, meta.write_slots, v[meta.write_rows])
    group_size = q.shape[1] // num_kv_heads if kv_head_map is None else None

    def heads(kv: torch.Tensor) -> torch.Tensor:  # [..., Hkv, D] -> [..., Hq, D]
        if kv_head_map is not None:
            return kv.index_select(-2, kv_head_map)
        return kv if group_size == 1 else kv.repeat_interleave(group_size, dim=-2)

    outputs = []
    if meta.num_decode:
        tables = meta.decode_block_tables
        kd = heads(gather_blocks(k_cache, tables)).transpose(1, 2)  # [B, Hq, L, D]
        vd = heads(gather_blocks(v_cache, tables)).transpose(1, 2)
        qd = q[: meta.num_decode, :, None, :]  # [B, Hq, 1, D]
        o, lse = attention_with_lse(qd, kd, vd, meta.decode_mask, scale)  # [B, Hq, 1, D], [B, Hq, 1]
        outputs.append(_merge_over_ranks(meta.group, o[:, :, 0], lse[:, :, 0]).to(q.dtype))  # [B, Hq, D]
    for span in meta.spans:
        qs, ks, vs = q[span.rows], k[span.rows], v[span.rows]  # [n, H, D]
        cached_k, cached_v = flat_k[span.cached_slots], flat_v[span.cached_slots]  # [c, Hkv, D]
        my_k, my_v = torch.cat([cached_k, ks]), torch.cat([cached_v, vs])  # [c + n, Hkv, D]
        if span.choice.method is CPMethod.PASS_KV:
            o = _pass_kv(meta.group, qs, my_k, my_v, span, scale, heads)
        else:
            o = _pass_q(meta.group, qs, my_k, my_v, span, scale, heads)
        outputs.append(o.to(q.dtype))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _merge_over_ranks(group, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out [B, H, D], lse [B, H] from every rank -> the exact attention [B, H, D]."""
    world = group.size()
    packed = torch.cat([out, lse[..., None]], dim=-1).contiguous()  # [B, H, D+1] float32
    gathered = packed.new_empty((world, *packed.shape))  # [W, B, H, D+1]
    group._allgather_base(gathered.view(-1), packed.view(-1)).wait()
    merged, _ = merge_partials(gathered[..., :-1], gathered[..., -1])
    return merged


def _ring_peers(group) -> tuple[int, int]:
    rank, world = group.rank(), group.size()
    return (rank + 1) % world, (rank - 1) % world


def _attend_block(q: torch.Tensor, queries: tuple[Segment, ...], k: torch.Tensor, v: torch.Tensor,
                  keys: tuple[Segment, ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, Hq, D] against k/v [Tk, Hq, D] run by run: a key run before the query run is attended
    whole, the same run causally, a later one not at all (no masks: the runs' positions say it all).
    -> (O [Tq, Hq, D], LSE [Tq, Hq]) float32; rows outside `queries` get LSE -inf."""
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
    k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hq, Tk, D]
    for qs in queries:
        q4 = q[qs.start:qs.end].transpose(0, 1)[None]  # [1, Hq, n, D]
        visible = [(ks, how) for ks in keys if (how := sees(qs.run, ks.run))]
        whole = [ks for ks, how in visible if how is Visibility.WHOLE]
        parts = []
        if whole:  # the segments attended whole are contiguous in the block: one call
            lo, hi = whole[0].start, whole[-1].end
            parts.append(attention_with_lse(q4, k4[:, :, lo:hi], v4[:, :, lo:hi], None, scale))
        for ks, how in visible:
            if how is Visibility.CAUSAL:
                parts.append(attention_with_lse(q4, k4[:, :, ks.start:ks.end], v4[:, :, ks.start:ks.end], None, scale,
                                                causal=True))
        if parts:
            o, s = merge_partials(torch.stack([o[0] for o, _ in parts]), torch.stack([s[0] for _, s in parts]))
            out[qs.start:qs.end], lse[qs.start:qs.end] = o.transpose(0, 1), s.transpose(0, 1)
    return out, lse


def _pass_kv(group, q, my_k, my_v, span: CPSpan, scale, heads) -> torch.Tensor:
    """q [n, Hq, D]; my_k/my_v [c + n, Hkv, D]. KV blocks travel the ring; returns [n, Hq, D]."""
    rank, world = group.rank(), group.size()
    send_to, recv_from = _ring_peers(group)
    block = torch.stack([my_k, my_v])  # [2, c + n, Hkv, D]
    block = torch.nn.functional.pad(block, (0, 0, 0, 0, 0, span.kv_len - block.shape[1])).contiguous()  # [2, L, Hkv, D]
    outs, lses = [], []
    for step in range(world):
        pending = []
        if step < world - 1:  # post the next exchange before computing on the block in hand
            incoming = torch.empty_like(block)
            pending = [group.send([block], send_to, step), group.recv([incoming], recv_from, step)]
        source = (rank - step) % world
        k, v = heads(block[0]), heads(block[1])  # [L, Hq, D]
        o, lse = _attend_block(q, span.query_layouts[rank], k, v, span.kv_layouts[source], scale)
        outs.append(o)
        lses.append(lse)
        for work in pending:
            work.wait()
        if pending:
            block = incoming
    out, _ = merge_partials(torch.stack(outs), torch.stack(lses))
    return out


def _pass_q(group, q, my_k, my_v, span: CPSpan, scale, heads) -> torch.Tensor:
    """Queries travel the ring; an all-to-all returns each partial (O, LSE) to the query's rank."""
    rank, world = group.rank(), group.size()
    send_to, recv_from = _ring_peers(group)
    n, num_heads, head_dim = q.shape
    block = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, span.q_len - n)).contiguous()  # [n_max, Hq, D]
    k, v = heads(my_k), heads(my_v)  # [c + n, Hq, D]
    partials = torch.empty((world, span.q_len, num_heads, head_dim + 1))  # per query owner: O and LSE
    for step in range(world):
        pending = []
        if step < world - 1:
            incoming = torch.empty_like(block)
            pending = [group.send([block], send_to, step), group.recv([incoming], recv_from, step)]
        source = (rank - step) % world
        o, lse = _attend_block(block, span.query_layouts[source], k, v, span.kv_layouts[rank], scale)
        partials[source] = torch.cat([o, lse[..., None]], dim=-1)  # [n_max, Hq, D+1]
        for work in pending:
            work.wait()
        if pending:
            block = incoming
    returned = torch.empty_like(partials)  # [W, n_max, Hq, D+1]: my queries' partials from every rank
    group.alltoall_base(returned, partials, [], []).wait()
    out, _ = merge_partials(returned[:, :n, :, :-1], returned[:, :n, :, -1])
    return out
