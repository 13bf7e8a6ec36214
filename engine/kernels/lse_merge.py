"""Exact merge of partial attention outputs by log-sum-exp (context parallelism, split-K decoding).

    O = Σ_s O_s·exp(LSE_s − LSE_max) / Σ_s exp(LSE_s − LSE_max),  LSE = LSE_max + log Σ_s exp(LSE_s − LSE_max)

`merge_lse(outputs [S, T, H, D], lses [S, T, H])` -> (O [T, H, D], LSE [T, H]), float32.
A partial with LSE = −inf weighs nothing; a row with no finite LSE gives O = 0, LSE = −inf.
One program per (token, head) row; S partials are read in two passes (max, then sums).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_lse(out_ptr, lse_ptr, merged_ptr, merged_lse_ptr, num_partials, rows,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.full((), float("-inf"), tl.float32)
    for s in range(0, num_partials):
        m = tl.maximum(m, tl.load(lse_ptr + s * rows + row))
    finite_m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s in range(0, num_partials):
        w = tl.exp(tl.load(lse_ptr + s * rows + row) - finite_m)
        total += w
        acc += w * tl.load(out_ptr + (s * rows + row) * HEAD_DIM + d, mask=d_ok, other=0.0)
    has = total > 0
    tl.store(merged_ptr + row * HEAD_DIM + d, tl.where(has, acc / tl.where(has, total, 1.0), 0.0), mask=d_ok)
    tl.store(merged_lse_ptr + row, tl.where(has, finite_m + tl.log(tl.where(has, total, 1.0)), float("-inf")))


def merge_lse(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if outputs.dim() != 4 or lses.shape != outputs.shape[:3]:
        raise ValueError(f"need outputs [S, T, H, D] and lses [S, T, H]; "
                         f"got {tuple(outputs.shape)} and {tuple(lses.shape)}")
    if outputs.dtype != torch.float32 or lses.dtype != torch.float32:
        raise ValueError(f"partials must be float32, got {outputs.dtype} and {lses.dtype}")
    num_partials, tokens, heads, head_dim = outputs.shape
    outputs, lses = outputs.contiguous(), lses.contiguous()
    merged = torch.empty((tokens, heads, head_dim), dtype=torch.float32, device=outputs.device)
    merged_lse = torch.empty((tokens, heads), dtype=torch.float32, device=outputs.device)
    if tokens * heads:
        _merge_lse[(tokens * heads,)](outputs, lses, merged, merged_lse, num_partials, tokens * heads,
                                      HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim))
    return merged, merged_lse
