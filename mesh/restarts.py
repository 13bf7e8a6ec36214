"""When `infermesh up` restarts a process of the mesh that exited abnormally: a pure policy.

A process that exits with a code other than 0 (a crash, a kill) is started again after a back-off that
doubles with each restart it had in the last `window_s`: `first_backoff_s`, twice that, four times... up to
`max_backoff_s`. Once it has been restarted `max_restarts` times within `window_s` it is left down: a
process that crashes at every start stops costing the host a start-up every few seconds, and the operator
sees why in `infermesh status`. Exit code 0 is a clean exit (a drain) and is never restarted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts of one process within window_s; past them it stays down (0: never restart)
    window_s: float = 600.0
    first_backoff_s: float = 1.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 < self.first_backoff_s <= self.max_backoff_s or self.window_s <= 0:
            raise ValueError(f"need 0 < first_backoff_s <= max_backoff_s and window_s > 0, got "
                             f"{self.first_backoff_s}, {self.max_backoff_s} and {self.window_s}")


@dataclass(frozen=True, slots=True)
class Restart:
    """What to do with a process that just exited abnormally: start it again in `delay_s` (None: leave it
    down), and why."""

    delay_s: float | None
    reason: str


def decide(policy: RestartPolicy, code: int, restarted_at: tuple[float, ...], now: float) -> Restart:
    """The decision for a process that exited with `code` at `now`, restarted before at `restarted_at`
    (monotonic seconds)."""
    exited = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
    recent = sum(now - t < policy.window_s for t in restarted_at)
    if recent >= policy.max_restarts:
        return Restart(None, f"{exited}; left down after {recent} restarts in {policy.window_s:.0f} s "
                             f"(--max-restarts {policy.max_restarts})")
    delay = min(policy.max_backoff_s, policy.first_backoff_s * 2 ** recent)
    return Restart(delay, f"{exited}; restart {recent + 1} of {policy.max_restarts} in "
                          f"{policy.window_s:.0f} s, in {delay:g} s")
