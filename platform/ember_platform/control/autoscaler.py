"""The autoscaler's rule: how many replicas a deployment should run, from its demand and its [scaling].

Demand is what the gateway sees: requests open on replicas plus requests waiting for one. The rule
(Knative's "concurrency" autoscaling, without its panic window):

- want = ceil(demand / target_concurrency), within [min_replicas, max_replicas], and at least one
  while anything is open or waiting;
- more replicas are started at once (queueing is what a user feels);
- fewer only after `want` has stayed lower for `scale_down_delay`: a burst's gaps do not churn
  replicas, and a scale-to-zero deployment (min_replicas = 0) stops its last replica only after a
  full idle delay. Removed replicas drain first, so nothing in flight is lost.

Pure functions over plain numbers, so the rule is tested without processes or clocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    min_replicas: int
    max_replicas: int
    target_concurrency: int
    scale_down_delay: float  # seconds


@dataclass(slots=True)
class ScaleMemory:
    """What the rule remembers between ticks for one deployment: since when fewer replicas would do."""

    lower_since: float | None = None


def wanted_replicas(policy: ScalingPolicy, demand: int) -> int:
    """Replicas for `demand` requests (open + waiting), within the policy's bounds."""
    want = math.ceil(demand / policy.target_concurrency) if demand > 0 else 0
    want = max(want, policy.min_replicas, 1 if demand > 0 else 0)
    return min(want, policy.max_replicas)


def decide(policy: ScalingPolicy, current: int, demand: int, now: float, memory: ScaleMemory) -> int:
    """The new desired replica count, given the current one; updates `memory`."""
    want = wanted_replicas(policy, demand)
    if want >= current:
        memory.lower_since = None
        return want
    if memory.lower_since is None:
        memory.lower_since = now
    if now - memory.lower_since >= policy.scale_down_delay:
        memory.lower_since = None
        return want
    return current
