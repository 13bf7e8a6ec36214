"""The SLO planner, as pure functions: how many prefill and decode instances the mesh should have.

Input: windows of the router's metrics (`window`: the difference of two scrapes of its cumulative
counters and histograms — requests, tokens, and the p90 of time to first token and time per output
token in the window), oldest first. Prefill instances are sized on TTFT, decode instances on TPOT, each
by the same rule (`decide`):

- over the SLO in the latest window: scale up at once, to n * (p90 / SLO) rounded up (at most double,
  at least one more): how much faster the role must be, taken as how many more instances it needs;
- under `low_water` * SLO (or idle) in each of the last `settle_windows` windows: one fewer (never below
  the bounds), so a step down waits for evidence and is small;
- in between: no change. The band between low water and the SLO is the hysteresis that keeps a noisy
  plateau from oscillating, and one step down at a time never undershoots by more than one instance.

This follows Dynamo's load-based planner (step on observed latency against the SLO) and answers its
users' complaints about it: it does scale down, and it does not oscillate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

Samples = Mapping[tuple[str, tuple], float]  # (sample name, sorted labels) -> value, one scrape


@dataclass(frozen=True, kw_only=True, slots=True)
class Window:
    seconds: float
    requests: float  # finished in the window
    ttft_p90_s: float | None  # None: no request finished
    tpot_p90_s: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    low_water: float = 0.5  # a window under low_water * SLO counts toward one instance fewer
    settle_windows: int = 3  # that many such windows in a row before a step down
    min_prefill: int = 0
    max_prefill: int = 16
    min_decode: int = 1
    max_decode: int = 16

    def __post_init__(self) -> None:
        if not (self.ttft_slo_s > 0 and self.tpot_slo_s > 0):
            raise ValueError(f"SLOs must be > 0, got ttft {self.ttft_slo_s} s and tpot {self.tpot_slo_s} s")
        if not 0 < self.low_water < 1:
            raise ValueError(f"low_water must be in (0, 1), got {self.low_water}")
        if self.settle_windows < 1:
            raise ValueError(f"settle_windows must be >= 1, got {self.settle_windows}")
        if not (0 <= self.min_prefill <= self.max_prefill and 1 <= self.min_decode <= self.max_decode):
            raise ValueError(f"need 0 <= min_prefill ({self.min_prefill}) <= max_prefill ({self.max_prefill}) and "
                             f"1 <= min_decode ({self.min_decode}) <= max_decode ({self.max_decode})")


@dataclass(frozen=True, slots=True)
class Plan:
    prefill: int
    decode: int
    reason: str


def decide(current: int, latencies: Sequence[float | None], slo_s: float, low: int, high: int, low_water: float,
           settle_windows: int) -> tuple[int, str]:
    """One role's count from its p90 latency in each window (oldest first; None: idle)."""
    latest = latencies[-1] if latencies else None
    if latest is not None and latest > slo_s:
        target = max(current + 1, min(2 * max(current, 1), math.ceil(max(current, 1) * latest / slo_s)))
        target = min(high, target)
        return target, f"p90 {latest * 1000:.0f} ms > SLO {slo_s * 1000:.0f} ms: {current} -> {target}"
    recent = list(latencies[-settle_windows:])
    if len(recent) == settle_windows and all(x is None or x < low_water * slo_s for x in recent) and current > low:
        return current - 1, (f"p90 under {low_water:.0%} of the SLO for {settle_windows} windows: "
                             f"{current} -> {current - 1}")
    return max(low, min(high, current)), "within the SLO band: no change"


def plan(windows: Sequence[Window], prefill: int, decode: int, config: PlannerConfig) -> Plan:
    """The counts for the mesh that had `prefill` and `decode` instances over `windows` (oldest first)."""
    c = config
    p, p_why = decide(prefill, [w.ttft_p90_s for w in windows], c.ttft_slo_s, c.min_prefill, c.max_prefill,
                      c.low_water, c.settle_windows)
    d, d_why = decide(decode, [w.tpot_p90_s for w in windows], c.tpot_slo_s, c.min_decode, c.max_decode,
                      c.low_water, c.settle_windows)
    return Plan(p, d, f"prefill (TTFT): {p_why}; decode (TPOT): {d_why}")


def window(before: Samples, after: Samples, seconds: float) -> Window:
    """The router's metrics between two scrapes."""
    requests = _value(after, "infermesh_requests_total", outcome="ok") - _value(
        before, "infermesh_requests_total", outcome="ok")
    return Window(seconds=seconds, requests=requests,
                  ttft_p90_s=histogram_quantile(0.9, before, after, "infermesh_time_to_first_token_seconds"),
                  tpot_p90_s=histogram_quantile(0.9, before, after, "infermesh_time_per_output_token_seconds"))


def histogram_quantile(q: float, before: Samples, after: Samples, name: str) -> float | None:
    """The q-quantile of what a Prometheus histogram observed between two scrapes (linear within the bucket
    that holds it, as PromQL's histogram_quantile); None when it observed nothing."""
    buckets = sorted((float(dict(labels)["le"]), after[(key, labels)] - before.get((key, labels), 0.0))
                     for key, labels in after if key == f"{name}_bucket")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: the best a histogram can say
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def _value(samples: Samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
