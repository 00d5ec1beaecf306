"""Crash-loop backoff: how long a deployment waits before it replaces a replica that failed again.

Kubernetes' CrashLoopBackOff, per deployment rather than per container: the first failure is replaced at once (a
lost process or device is usually a one-off), each further failure in a row doubles the wait, from `base_s` up to
`max_s`, and a replica that then stays ready for `reset_after_s` clears the count. Without it, a replica that fails
every time (a broken package, a bad device) was restarted every couple of seconds forever, each restart loading the
weights again, and every request waited for a replacement that would fail too.

Pure state over plain numbers and a clock the caller passes in, so the rule is tested without processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """`base_s`: the wait after the second failure in a row; doubled for each further one, at most `max_s`.
    `reset_after_s`: how long a replica must stay ready for the failures before it to be forgiven."""

    base_s: float = 1.0
    max_s: float = 60.0
    reset_after_s: float = 120.0

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.max_s < self.base_s or self.reset_after_s < 0:
            raise ValueError(f"backoff: expected 0 <= base_s <= max_s and reset_after_s >= 0, got {self}")

    def delay(self, failures: int) -> float:
        """Seconds between the `failures`-th failure in a row and the replacement's start."""
        if failures <= 1:
            return 0.0
        return min(self.max_s, self.base_s * 2.0 ** (failures - 2))


@dataclass(slots=True)
class RestartBackoff:
    """One deployment's crash-loop state, shown in `/admin/deployments/NAME` under "restarts"."""

    failures: int = 0                     # replica failures in a row (none ready long enough since)
    restarts: int = 0                     # replacements started for failed replicas, ever
    last_failure: str | None = None       # what failed, in words fit for a response body (no exception text)
    last_failure_at: float | None = None  # wall-clock time
    delay_s: float = 0.0                  # the wait chosen after the last failure
    next_restart_at: float | None = None  # monotonic time before which no replacement starts

    def failed(self, policy: BackoffPolicy, reason: str, now: float) -> float:
        """A replica failed (its engine died, its process exited, or it did not start): the wait before the next."""
        self.failures += 1
        self.last_failure, self.last_failure_at = reason, time.time()
        self.delay_s = policy.delay(self.failures)
        self.next_restart_at = now + self.delay_s
        return self.delay_s

    def remaining(self, now: float) -> float:
        """Seconds until a replacement may start (0: now)."""
        if self.next_restart_at is None:
            return 0.0
        return max(0.0, self.next_restart_at - now)

    def restarted(self) -> None:
        """A replacement for a failed replica was started."""
        self.restarts += 1

    def forgive(self, policy: BackoffPolicy, ready_since: float | None, now: float) -> bool:
        """A replica has been ready since `ready_since`: clear the failures once that is `reset_after_s` ago."""
        if self.failures == 0 or ready_since is None or now - ready_since < policy.reset_after_s:
            return False
        self.failures, self.delay_s, self.next_restart_at = 0, 0.0, None
        return True

    def clear(self) -> None:
        """An operation (deploy, promote, rollback) started replicas that became ready: a fresh start."""
        self.failures, self.delay_s, self.next_restart_at = 0, 0.0, None

    def to_json(self, now: float) -> dict[str, Any]:
        remaining = self.remaining(now)
        return {"count": self.restarts, "failures_in_a_row": self.failures, "last_failure": self.last_failure,
                "last_failure_at": self.last_failure_at, "backoff_s": self.delay_s,
                "next_restart_in_s": round(remaining, 3) if remaining > 0 else None,
                "next_restart_at": time.time() + remaining if remaining > 0 else None}
