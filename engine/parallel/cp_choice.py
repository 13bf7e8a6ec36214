"""Pass-KV or pass-Q for a context-parallel prefill (arXiv 2411.01783, Alg. 1 and Alg. 5).

With T new tokens, P cached tokens, N ranks, N_H query heads, N_KV KV heads, peak
compute C (FLOP/s), bandwidth BW (bytes/s) and e bytes per element:

- pass-KV when T >= N·C·N_KV·e / (2·N_H·BW): the KV ring hides under attention compute;
- or when T/(T+P) >= 2·N_KV/N_H: the KV message is no larger than Q's
  (Alg. 5 counts pass-Q's all-to-all: the bound drops by 4·T·BW/(N·C·e));
- otherwise pass-Q. A full prefill (P = 0) is always pass-KV.

For Llama3-405B heads (N_H = 128, N_KV = 8) the miss-rate bound is 2·8/128 = 12.5%.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CPMethod(enum.Enum):
    PASS_KV = "pass_kv"
    PASS_Q = "pass_q"


@dataclass(frozen=True, kw_only=True, slots=True)
class CPChoice:
    method: CPMethod
    reason: str


def choose_cp_method(*, new_tokens: int, cached_tokens: int, cp_size: int, num_heads: int, num_kv_heads: int,
                     peak_flops: float, bandwidth: float, bytes_per_element: int,
                     count_all_to_all: bool = True) -> CPChoice:
    T, P, N = new_tokens, cached_tokens, cp_size
    if T < 1 or P < 0 or N < 1:
        raise ValueError(f"need new_tokens >= 1, cached_tokens >= 0, cp_size >= 1; got {T}, {P}, {N}")
    if P == 0:
        return CPChoice(method=CPMethod.PASS_KV, reason="full prefill (no cached tokens)")
    hide_bound = N * peak_flops * num_kv_heads * bytes_per_element / (2 * num_heads * bandwidth)
    if T >= hide_bound:
        return CPChoice(method=CPMethod.PASS_KV, reason=f"T={T} >= {hide_bound:.0f}: KV ring hidden under compute")
    miss_bound = 2 * num_kv_heads / num_heads
    if count_all_to_all:
        miss_bound -= 4 * T * bandwidth / (N * peak_flops * bytes_per_element)
    miss_rate = T / (T + P)
    if miss_rate >= miss_bound:
        return CPChoice(method=CPMethod.PASS_KV, reason=f"miss rate {miss_rate:.4f} >= {miss_bound:.4f}")
    return CPChoice(method=CPMethod.PASS_Q,
                    reason=f"miss rate {miss_rate:.4f} < {miss_bound:.4f} and T={T} < {hide_bound:.0f}")
