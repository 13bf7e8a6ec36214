"""Rotary embeddings and attention over the paged KV cache (the torch path).

A step's batch is flat: T new tokens from several sequences. `AttentionMetadata`
says where each new token's K/V goes in the cache (`slot_mapping`) and how the
queries group: the first `num_decode` tokens are single-token queries of distinct
sequences (decode steps, or one-token prefill chunks), run together over their
block tables; then one `PrefillSpan` per multi-token chunk. The masks are built
once per step here, not once per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import RopeScaling
from engine.kernels import cpu_decode, cpu_ops, cpu_prefill


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    start: int  # first row of this chunk in the flat batch
    num_tokens: int
    context_len: int  # cached prefix + this chunk
    block_table: torch.Tensor | None  # [blocks] int64; None when the chunk has no prefix
    mask: torch.Tensor | None  # [num_tokens, context_len] bool; None means plain causal


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset of each new token
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int64
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool
    decode_context_lens: torch.Tensor | None  # [num_decode] int32 (the CUDA kernel's mask)
    prefills: tuple[PrefillSpan, ...]


def build_metadata(
    *,
    slot_mapping: list[int],
    decode_block_tables: list[list[int]],
    decode_context_lens: list[int],
    prefill_chunks: list[tuple[int, int, list[int]]],  # (num_tokens, context_len, block_table)
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Tensors and masks for one step; decode rows come first in the flat batch."""
    num_decode = len(decode_block_tables)
    tables = mask = lens = None
    if num_decode:
        width = max(len(t) for t in decode_block_tables)
        padded = [t + [0] * (width - len(t)) for t in decode_block_tables]
        tables = torch.tensor(padded, dtype=torch.long, device=device)
        lens = torch.tensor(decode_context_lens, dtype=torch.int32, device=device)
        mask = (torch.arange(width * block_size, device=device)[None, :] < lens[:, None])[:, None, None, :]
    spans, start = [], num_decode
    for num_tokens, context_len, table in prefill_chunks:
        if context_len == num_tokens:
            spans.append(PrefillSpan(start, num_tokens, context_len, None, None))
        else:
            first = context_len - num_tokens
            q_pos = torch.arange(first, context_len, device=device)
            span_mask = torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]  # [n, ctx]
            blocks = torch.tensor(table[: math.ceil(context_len / block_size)], dtype=torch.long, device=device)
            spans.append(PrefillSpan(start, num_tokens, context_len, blocks, span_mask))
        start += num_tokens
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        num_decode=num_decode,
        decode_block_tables=tables,
        decode_mask=mask,
        decode_context_lens=lens,
        prefills=tuple(spans),
    )


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_head_map: torch.Tensor | None = None,  # [Hq]: KV head of each query head, when not plain GQA groups
) -> torch.Tensor:
    """Store the new K/V in the cache, then attend; returns [T, Hq, D]."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    outputs = []
    if meta.num_decode and q.is_cuda and kv_head_map is None:
        from engine.kernels.paged_decode import paged_decode_attention  # Triton: CUDA only

        od, _ = paged_decode_attention(q[: meta.num_decode].contiguous(), k_cache, v_cache,
                                       meta.decode_block_tables, meta.decode_context_lens, scale)
        outputs.append(od)  # [B, Hq, D]
    elif meta.num_decode and q.device.type == "cpu" and cpu_ops.available():
        outputs.append(cpu_decode.paged_decode(q[: meta.num_decode], k_cache, v_cache, meta.decode_block_tables,
                                               meta.decode_context_lens, scale, kv_head_map))  # [B, Hq, D]
    elif meta.num_decode:  # torch: gather each sequence's context, then SDPA
        mask = meta.decode_mask
        kd, vd = gather_blocks(k_cache, meta.decode_block_tables), gather_blocks(v_cache, meta.decode_block_tables)
        kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # [B, Hkv, L, D]
        batch, num_heads = meta.num_decode, q.shape[1]
        if kv_head_map is None:  # plain GQA: a group's query heads are query rows of one KV head, read once
            qd = q[:batch].view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
        else:
            kd, vd = for_query_heads(kd, kv_head_map), for_query_heads(vd, kv_head_map)
            qd = q[:batch, :, None, :]  # [B, Hq, 1, D]
        # In the cache's dtype: on CPU, up-casting the gathered context to float32 first (once faster) now costs
        # 1.3-10x the attention itself (torch 2.13).
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        outputs.append(od.reshape(batch, num_heads, head_dim))  # [B, Hq, D]
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        if span.block_table is None:
            ks, vs = k[rows], v[rows]  # [n, Hkv, D]
        else:  # the cached prefix and this chunk, from the cache
            ks = gather_blocks(k_cache, span.block_table)[: span.context_len]  # [ctx, Hkv, D]
            vs = gather_blocks(v_cache, span.block_table)[: span.context_len]
        if cpu_prefill.takes(q, ks):  # the chunk is the context's last tokens: causal with an offset
            outputs.append(cpu_prefill.prefill_attention(q[rows], ks, vs, scale, True, kv_head_map)[0])
            continue
        qs = q[rows].transpose(0, 1)[None]  # [1, Hq, n, D]: 4-D inputs take the fused CPU kernel
        ks, vs = (for_query_heads(t.transpose(0, 1)[None], kv_head_map) for t in (ks, vs))  # [1, Hkv, ctx, D]
        if span.block_table is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scale, enable_gqa=True)
        outputs.append(o[0].transpose(0, 1))  # [n, Hq, D]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def fused_decode(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, num_heads: int,
                 kv_head_map: torch.Tensor | None = None) -> torch.Tensor | None:
    """A step of decode rows only, on CPU, from a layer's fused projection qkv [T, (Hq + 2 Hkv) D]: RoPE, the
    cache write and the attention in one kernel call (engine/kernels/cpu_paged_decode.cpp, `decode_attention`:
    the same roundings as rotate_, the cache write and paged_decode) -> [T, Hq * D]; None where it does not
    apply (a prefill chunk in the step, another device, no kernels)."""
    if not meta.num_decode or meta.prefills or not cpu_ops.takes(qkv, k_cache):  # decode rows only, or not
        return None
    heads = cpu_decode.gqa_heads(num_heads, k_cache.shape[2]) if kv_head_map is None else kv_head_map
    return cpu_ops.ops().decode_attention(qkv, rope[0], rope[1], k_cache, v_cache, meta.slot_mapping,
                                          meta.decode_block_tables, meta.decode_context_lens, heads, scale, num_heads)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The cache's rows for block ids `tables` [..., blocks], as [..., blocks * block_size, H, D] (one copy).
    `index_select`: on CPU 2.5-4x faster than indexing with `cache[tables]`."""
    _, block_size, heads, dim = cache.shape
    rows = cache.index_select(0, tables.flatten())  # [prod(tables.shape), block_size, H, D]
    return rows.view(*tables.shape[:-1], tables.shape[-1] * block_size, heads, dim)


def for_query_heads(kv: torch.Tensor, kv_head_map: torch.Tensor | None) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hq, L, D] by the map; unchanged without one (SDPA then groups heads itself)."""
    return kv if kv_head_map is None else kv.index_select(1, kv_head_map)


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_position), computed in float32 as HF does."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling, device=None) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        inv_freq = _scale_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, device=device).float(), inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's tokens, [T, 1, D] each: looked up once per step, used by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; rotate each token by its position (cos, sin from RotaryEmbedding.tables)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope`, in place on CPU (the C++ kernel, the same roundings; x is returned), else a new tensor:
    callers pass an x they own and use what is returned."""
    if x.stride(-1) == 1 and cpu_ops.takes(x, cos, sin):
        return cpu_ops.ops().rope_(x, cos, sin)
    return apply_rope(x, cos, sin)


def _scale_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "llama3":
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq
