"""Which cores each engine process of a host runs on, as pure functions (torch-free: the supervisor plans
with them; `engine.threads.pin` applies a plan inside the process).

Engine processes that share cores fight: each runs torch's intra-op (OpenMP) team, whose threads spin at
every barrier of every op, so two teams on the same two cores wait on each other's preempted threads
(a disaggregated layout's TPOT p50 0.12 → 0.97–1.36 s once neither team was
throttled). `infermesh up` therefore gives each engine instance its own cores (`share`), in proportion to
its ranks; an instance's ranks then split its cores by thread count.

A core list is written as Linux writes them (`/sys/devices/system/cpu/online`, `taskset -c`): "0-3,8".
"""

from __future__ import annotations

import os
from typing import Sequence


def available_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def parse_cpus(text: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8] (sorted, each once); ValueError naming the text."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if not 0 <= low <= high:
                raise ValueError(part)
            cores.update(range(low, high + 1))
    except ValueError:
        raise ValueError(f"cpus={text!r} is not a core list such as 0-3,8") from None
    return sorted(cores)


def format_cpus(cores: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def share(cores: Sequence[int], weights: Sequence[int]) -> list[list[int]]:
    """`cores` dealt out in contiguous runs, one run per weight and in proportion to it: at least one core
    each, the cores that rounding down leaves to the largest remainders (the earlier part on a tie). With
    no more cores than parts, each part gets one core, parts sharing them in turn."""
    if not cores or not weights or min(weights) < 1:
        raise ValueError(f"need cores and weights >= 1, got {len(cores)} cores and weights {list(weights)}")
    if len(weights) >= len(cores):
        return [[cores[i % len(cores)]] for i in range(len(weights))]
    quotas = [len(cores) * w / sum(weights) for w in weights]
    counts = [max(1, int(q)) for q in quotas]
    while sum(counts) > len(cores):  # the floor of one core each overshot: take from the largest
        counts[max(range(len(counts)), key=lambda i: (counts[i], i))] -= 1
    by_remainder = sorted(range(len(counts)), key=lambda i: (-(quotas[i] - int(quotas[i])), i))
    for i in by_remainder[:len(cores) - sum(counts)]:
        counts[i] += 1
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [list(cores[start:start + count]) for start, count in zip(starts, counts)]
