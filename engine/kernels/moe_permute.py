"""MoE token permute and un-permute (+ gate weighting), as expert parallelism uses them.

- `permute_rows(x [T, D], source_rows [N])` -> [N, D]: row i is x[source_rows[i]]
  (tokens laid out by destination expert before the dispatch all-to-all);
- `combine_rows(y [N, D], slot_rows [T, k], weights [T, k])` -> [T, D]:
  out[t] = Σ_j weights[t, j] · y[slot_rows[t, j]], accumulated in float32
  (results back from the experts, un-permuted and weighted in one pass).

Grid (row, column block); rows are read and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _permute_rows(x_ptr, src_ptr, out_ptr, dim, stride_x, stride_out, BLOCK_D: tl.constexpr):
    row, col_block = tl.program_id(0), tl.program_id(1)
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < dim
    src = tl.load(src_ptr + row).to(tl.int64)
    tl.store(out_ptr + row * stride_out + cols, tl.load(x_ptr + src * stride_x + cols, mask=ok), mask=ok)


@triton.jit
def _combine_rows(y_ptr, slots_ptr, w_ptr, out_ptr, dim, stride_y, stride_out, TOP_K: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    token, col_block = tl.program_id(0), tl.program_id(1)
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < dim
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slots_ptr + token * TOP_K + j).to(tl.int64)
        w = tl.load(w_ptr + token * TOP_K + j).to(tl.float32)
        acc += w * tl.load(y_ptr + slot * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, D] with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")


def permute_rows(x: torch.Tensor, source_rows: torch.Tensor, block_d: int = 128) -> torch.Tensor:
    _check_rows(x, "x")
    if source_rows.dim() != 1:
        raise ValueError(f"source_rows must be 1-D, got shape {tuple(source_rows.shape)}")
    out = x.new_empty((source_rows.shape[0], x.shape[1]))
    if out.numel():
        grid = (source_rows.shape[0], triton.cdiv(x.shape[1], block_d))
        _permute_rows[grid](x, source_rows.contiguous(), out, x.shape[1], x.stride(0), out.stride(0), BLOCK_D=block_d)
    return out


def combine_rows(y: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor, block_d: int = 128) -> torch.Tensor:
    _check_rows(y, "y")
    if slot_rows.dim() != 2 or weights.shape != slot_rows.shape:
        raise ValueError(f"slot_rows and weights must both be [T, k], got {tuple(slot_rows.shape)} "
                         f"and {tuple(weights.shape)}")
    tokens, top_k = slot_rows.shape
    out = y.new_empty((tokens, y.shape[1]))
    if out.numel():
        grid = (tokens, triton.cdiv(y.shape[1], block_d))
        _combine_rows[grid](y, slot_rows.contiguous(), weights.contiguous(), out, y.shape[1], y.stride(0),
                            out.stride(0), TOP_K=top_k, BLOCK_D=block_d)
    return out
