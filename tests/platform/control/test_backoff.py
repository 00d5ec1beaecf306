"""The crash-loop backoff rule on its own: waits, their cap, and forgiveness after a replica stays ready."""

from __future__ import annotations

import pytest

from ember_platform.control.backoff import BackoffPolicy, RestartBackoff


def test_the_first_failure_restarts_at_once_then_waits_double_up_to_the_cap() -> None:
    policy = BackoffPolicy(base_s=1.0, max_s=10.0)
    assert [policy.delay(n) for n in range(1, 8)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_failures_set_the_next_restart_and_a_replica_ready_long_enough_forgives_them() -> None:
    policy = BackoffPolicy(base_s=1.0, max_s=60.0, reset_after_s=30.0)
    backoff = RestartBackoff()
    assert backoff.failed(policy, "engine failed", now=100.0) == 0.0
    assert backoff.failed(policy, "engine failed", now=101.0) == 1.0
    assert backoff.remaining(101.5) == 0.5 and backoff.remaining(103.0) == 0.0
    view = backoff.to_json(101.5)
    assert view["failures_in_a_row"] == 2 and view["next_restart_in_s"] == 0.5 and view["last_failure"]
    assert not backoff.forgive(policy, ready_since=110.0, now=139.0)  # ready 29 s: not yet
    assert backoff.forgive(policy, ready_since=110.0, now=140.0)
    assert backoff.failures == 0 and backoff.failed(policy, "again", now=200.0) == 0.0


def test_a_policy_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="base_s <= max_s"):
        BackoffPolicy(base_s=5.0, max_s=1.0)
