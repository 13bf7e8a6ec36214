"""Paged decode attention, split-K (flash-decoding): one query token per sequence over its block table.

Grid (sequence, query head, split): each program walks its share of the
sequence's KV blocks with an online softmax and writes a partial output and its
log-sum-exp; `merge_lse` (the same merge context parallelism uses) combines the
splits. Splitting the context keeps every SM busy at batch 1 with long contexts.

    out, lse = paged_decode_attention(q [B, Hq, D], k_cache, v_cache [blocks, block_size, Hkv, D],
                                      block_tables [B, max_blocks] int32/int64, context_lens [B] int32, scale)

GQA by plain groups (query head h reads KV head h // (Hq // Hkv)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.decode_checks import check_decode_shapes
from engine.kernels.lse_merge import merge_lse


@triton.jit
def _paged_decode_split(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, scale,
                        stride_qb, stride_qh, stride_kblock, stride_ktok, stride_khead,
                        stride_tb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                        blocks_per_split, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    seq, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP
    context_len = tl.load(lens_ptr + seq)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)  # [D]
    m = tl.full((), float("-inf"), tl.float32)
    denom = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    first = split * blocks_per_split
    for i in range(0, blocks_per_split):
        logical = first + i
        pos = logical * BLOCK_SIZE + tok  # [BS]
        visible = pos < context_len
        if logical * BLOCK_SIZE < context_len:
            block = tl.load(tables_ptr + seq * stride_tb + logical).to(tl.int64)
            offs = block * stride_kblock + tok[:, None] * stride_ktok + kv_head * stride_khead + d[None, :]  # [BS, D]
            kv_ok = visible[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_ok, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=kv_ok, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1) * scale  # [BS]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=0))
            correction = tl.exp(m - m_new)
            p = tl.exp(scores - m_new)  # [BS]
            denom = denom * correction + tl.sum(p, axis=0)
            acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
            m = m_new
    has_keys = denom > 0
    out = tl.where(has_keys, acc / tl.where(has_keys, denom, 1.0), 0.0)
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, denom, 1.0)), float("-inf"))
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + split * stride_os + d, out, mask=d_ok)
    tl.store(lse_ptr + seq * stride_lb + head * stride_lh + split, lse)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, num_splits: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B, Hq, D] in q's dtype, lse [B, Hq] float32)."""
    check_decode_shapes(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if (q.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1
            or block_size & (block_size - 1)):
        raise ValueError("q and the caches need a contiguous last dim, equal cache strides and a power-of-2 block size")
    max_blocks = block_tables.shape[1]
    num_splits = num_splits or max(1, min(16, max_blocks // 4))
    blocks_per_split = -(-max_blocks // num_splits)
    partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _paged_decode_split[(batch, num_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, partial, partial_lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), partial.stride(0), partial.stride(1), partial.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        blocks_per_split, GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    # [B, Hq, S, D] -> [S, B*Hq, 1, D]: the splits are the partials to merge
    out, lse = merge_lse(partial.permute(2, 0, 1, 3).reshape(num_splits, batch * num_heads, 1, head_dim),
                         partial_lse.permute(2, 0, 1).reshape(num_splits, batch * num_heads, 1))
    return out.view(batch, num_heads, head_dim).to(q.dtype), lse.view(batch, num_heads)
