"""The autoscaler: its rule on plain numbers, then scale up, scale to zero and a cold start with real replicas."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ember.registry import BlobCache, LocalRegistry, push_package
from ember_platform.control.autoscaler import ScaleMemory, ScalingPolicy, decide, wanted_replicas
from ember_platform.control.deployments import Replica, ReplicaState
from ember_platform.control.plane import ControlPlane
from ember_platform.replica.auth import auth_headers
from ember_plugins.launchers.local import LocalProcessLauncher

POLICY = ScalingPolicy(min_replicas=0, max_replicas=3, target_concurrency=4, scale_down_delay=10.0)


@pytest.mark.parametrize(("demand", "want"), [(0, 0), (1, 1), (4, 1), (5, 2), (12, 3), (100, 3)])
def test_wanted_replicas_follow_demand_within_bounds(demand: int, want: int) -> None:
    assert wanted_replicas(POLICY, demand) == want


def test_min_replicas_is_a_floor() -> None:
    policy = ScalingPolicy(min_replicas=2, max_replicas=3, target_concurrency=4, scale_down_delay=10.0)
    assert wanted_replicas(policy, 0) == 2 and wanted_replicas(policy, 1) == 2


def test_up_at_once_down_only_after_the_delay_and_gaps_reset_it() -> None:
    memory = ScaleMemory()
    assert decide(POLICY, current=1, demand=9, now=0.0, memory=memory) == 3  # queueing: at once
    assert decide(POLICY, current=3, demand=0, now=1.0, memory=memory) == 3  # idle, but not for long
    assert decide(POLICY, current=3, demand=0, now=9.0, memory=memory) == 3
    assert decide(POLICY, current=3, demand=12, now=9.5, memory=memory) == 3  # busy again: the clock restarts
    assert decide(POLICY, current=3, demand=0, now=10.0, memory=memory) == 3
    assert decide(POLICY, current=3, demand=0, now=19.9, memory=memory) == 3
    assert decide(POLICY, current=3, demand=0, now=20.0, memory=memory) == 0  # a full idle delay: to zero


def _info(replica: Replica) -> dict:
    import httpx

    return httpx.get(f"{replica.url}/info", headers=auth_headers(replica.secret), timeout=10).json()


@pytest.mark.usefixtures("one_thread_per_replica")
def test_scale_up_on_demand_then_to_zero_when_idle_then_a_cold_start(
        tmp_path: Path, example_copy: Callable[..., Path], until: Callable[..., Any]) -> None:
    pkg = example_copy(tmp_path / "pkg", prewarm=False, scale_down_delay="1s", target_concurrency=1)
    registry = LocalRegistry(tmp_path / "registry")
    push_package(pkg, registry)

    async def scenario() -> None:
        plane = ControlPlane(registry, packages_dir=tmp_path / "packages", cache=BlobCache(tmp_path / "cache"),
                             launcher=LocalProcessLauncher(log_dir=tmp_path / "logs", drain_timeout=5),
                             probe_interval=0.1)
        await plane.start()
        try:
            dep = await plane.deploy("tiny-llama")
            assert dep.desired == 0 and not dep.replicas  # scale to zero: nothing runs before traffic
            [first] = await plane.acquire("tiny-llama")  # a cold start
            # The gateway counts the requests it has open on a replica; three of them want three replicas,
            # capped at max_replicas = 2.
            first.in_flight = 3
            await until(lambda: len(dep.ready_replicas()) == 2, 90, "a second replica")
            assert dep.desired == 2 and any("scaling up to 2" in e for e in dep.events)

            # Still busy: nothing is removed however long it takes.
            await asyncio.sleep(1.5)
            assert len(dep.ready_replicas()) == 2
            first.in_flight = 0
            # Idle for the delay: the replicas sleep (KV cache freed, processes and weights kept)...
            sleepers = await until(lambda: dep.sleeping_replicas(), 30, "replicas to sleep")
            assert sleepers == dep.replicas and dep.desired == 0
            assert sleepers[0].url is not None
            info = await until(lambda: _info(sleepers[0]) if _info(sleepers[0])["sleeping"] else None, 30,
                                "the replica's engine to sleep")
            assert info["stats"]["kv_blocks_free"] == info["stats"]["kv_blocks_total"]
            # ...and a request wakes it at once: the same process, no cold start.
            woken = await plane.acquire("tiny-llama")
            assert woken == sleepers and all(r.state is ReplicaState.READY for r in woken)
            assert dep.desired == len(woken)

            await until(lambda: dep.sleeping_replicas(), 30, "sleeping again")
            await until(lambda: not dep.replicas, 30, "scaling to zero after sleeping for the delay")
            assert dep.desired == 0 and any("scaled to zero" in e for e in dep.events)

            [again] = await plane.acquire("tiny-llama")  # the next request succeeds after a cold start
            assert again.state is ReplicaState.READY and again not in woken
        finally:
            await plane.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 240))
