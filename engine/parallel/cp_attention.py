"""Context-parallel attention over the paged KV cache: pass-KV and pass-Q ring attention, CP decode.

Every CP rank holds a cache of the full size, indexed by the same block tables,
but fills only the slots of the tokens it owns (`CPAttentionMetadata.write_*`);
the other slots stay unread on that rank. So a sequence's KV is spread over the
ranks: prefill tokens live where the load-balanced sharding put them, decode
tokens round-robin by position. A rank attends only over the slots it owns
(`owned` masks) and partial results merge exactly by log-sum-exp:

- decode rows are replicated on every rank: each attends over its own slots, an
  all-gather brings every (O, LSE) and each rank merges them (pass-Q decode);
- a prefill span's new tokens are sharded. Pass-KV: each rank's KV (its cached
  prefix slots and its new tokens) travels the ring in N-1 steps, each send/recv
  posted before the attention on the block in hand so the two overlap. Pass-Q:
  the queries travel the ring instead, each rank attends the visiting queries to
  its own KV, and an all-to-all returns every partial (O, LSE) to the query's owner.

Masks are by absolute position (query position >= key position), computed once
per step for all layers; padding carries a position no query reaches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import for_query_heads
from engine.parallel.cp_choice import CPChoice, CPMethod
from engine.parallel.cp_merge import attention_with_lse, merge_partials

PAD_POSITION = 1 << 62  # a key position no query reaches; a query position that sees nothing


@dataclass(frozen=True, slots=True)
class CPSpan:
    """One prefill chunk, as this rank sees it."""

    rows: slice  # this rank's new tokens in the flat batch (possibly empty)
    cached_slots: torch.Tensor  # [c] cache slots of the cached prefix this rank owns
    choice: CPChoice
    # pass-KV: key positions of every rank's block (cached owned + new, padded to equal length)
    kv_masks: tuple[torch.Tensor, ...]  # per source rank: [n_local, L] bool, my queries x its keys
    # pass-Q: my KV against every rank's queries (padded to equal length)
    q_masks: tuple[torch.Tensor, ...]  # per source rank: [n_max, c + n_local] bool, its queries x my keys
    kv_len: int  # L: padded KV block length (pass-KV)
    q_len: int  # n_max: padded query block length (pass-Q)


@dataclass(frozen=True, slots=True)
class CPAttentionMetadata:
    group: object  # the CP process group
    write_rows: torch.Tensor  # [w] rows of the flat batch whose K/V this rank stores
    write_slots: torch.Tensor  # [w]
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks]
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool: in context and owned here
    spans: tuple[CPSpan, ...]


def context_parallel_attention(q, k, v, k_cache, v_cache, meta: CPAttentionMetadata, scale: float,
                               kv_head_map: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `paged_attention`: store owned K/V, attend; returns [T_local, Hq, D]."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    flat_k.index_copy_(0, meta.write_slots, k[meta.write_rows])
    flat_v.index_copy_(0, meta.write_slots, v[meta.write_rows])
    group_size = q.shape[1] // num_kv_heads if kv_head_map is None else None

    def heads(kv: torch.Tensor) -> torch.Tensor:  # [B, Hkv, L, D] -> [B, Hq, L, D]
        return for_query_heads(kv, kv_head_map) if kv_head_map is not None else kv.repeat_interleave(group_size, 1)

    outputs = []
    if meta.num_decode:
        tables = meta.decode_block_tables
        kd = heads(k_cache[tables].flatten(1, 2).transpose(1, 2))  # [B, Hq, L, D]
        vd = heads(v_cache[tables].flatten(1, 2).transpose(1, 2))
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


def _pass_kv(group, q, my_k, my_v, span: CPSpan, scale, heads) -> torch.Tensor:
    """q [n, Hq, D]; my_k/my_v [c + n, Hkv, D]. KV blocks travel the ring; returns [n, Hq, D]."""
    rank, world = group.rank(), group.size()
    send_to, recv_from = _ring_peers(group)
    block = torch.stack([my_k, my_v])  # [2, c + n, Hkv, D]
    block = torch.nn.functional.pad(block, (0, 0, 0, 0, 0, span.kv_len - block.shape[1])).contiguous()  # [2, L, Hkv, D]
    q4 = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    outs, lses = [], []
    for step in range(world):
        pending = []
        if step < world - 1:  # post the next exchange before computing on the block in hand
            incoming = torch.empty_like(block)
            pending = [group.send([block], send_to, step), group.recv([incoming], recv_from, step)]
        source = (rank - step) % world
        k4, v4 = heads(block[0].transpose(0, 1)[None]), heads(block[1].transpose(0, 1)[None])  # [1, Hq, L, D]
        o, lse = attention_with_lse(q4, k4, v4, span.kv_masks[source][None, None], scale)
        outs.append(o[0].transpose(0, 1))  # [n, Hq, D]
        lses.append(lse[0].transpose(0, 1))  # [n, Hq]
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
    k4, v4 = heads(my_k.transpose(0, 1)[None]), heads(my_v.transpose(0, 1)[None])  # [1, Hq, c + n, D]
    partials = torch.empty((world, span.q_len, num_heads, head_dim + 1))  # per query owner: O and LSE
    for step in range(world):
        pending = []
        if step < world - 1:
            incoming = torch.empty_like(block)
            pending = [group.send([block], send_to, step), group.recv([incoming], recv_from, step)]
        source = (rank - step) % world
        o, lse = attention_with_lse(block.transpose(0, 1)[None], k4, v4, span.q_masks[source][None, None], scale)
        partials[source] = torch.cat([o[0], lse[0][..., None]], dim=-1).transpose(0, 1)  # [n_max, Hq, D+1]
        for work in pending:
            work.wait()
        if pending:
            block = incoming
    returned = torch.empty_like(partials)  # [W, n_max, Hq, D+1]: my queries' partials from every rank
    group.alltoall_base(returned, partials, [], []).wait()
    out, _ = merge_partials(returned[:, :n, :, :-1], returned[:, :n, :, -1])
    return out
