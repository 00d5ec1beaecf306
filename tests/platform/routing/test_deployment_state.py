"""The control plane writes each deployment's state (cold, starting, warm, sleeping) to the routing tables the gateway
routes with, as it changes: in-process tables, and Redis shared with a second control plane that runs no replica of
the model and reads the first one's state. Real replica processes of the example model throughout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from ember.registry import BlobCache, LocalRegistry, push_package
from ember_platform.control.plane import ControlPlane
from ember_platform.gateway.app import create_app
from ember_platform.routing import DeploymentState
from ember_platform.routing.memory import InProcessTables
from ember_platform.routing.redis_tables import RedisTables
from ember_plugins.launchers.local import LocalProcessLauncher

MODEL = "tiny-llama"
T = TypeVar("T")
COLD, STARTING, WARM, SLEEPING = (DeploymentState.COLD, DeploymentState.STARTING, DeploymentState.WARM,
                                  DeploymentState.SLEEPING)


pytestmark = pytest.mark.usefixtures("one_thread_per_replica")
# How long the example (min_replicas = 0) stays idle before it scales to zero.
SCALE_DOWN_DELAY = "2s"


def make_plane(tmp: Path, registry: LocalRegistry, tables: Any, *, redis_url: str | None = None) -> ControlPlane:
    return ControlPlane(registry, packages_dir=tmp / "packages", cache=BlobCache(tmp / "cache"),
                        launcher=LocalProcessLauncher(log_dir=tmp / "logs", drain_timeout=5, redis_url=redis_url),
                        probe_interval=0.2, routing_tables=tables)


def run(coro: Awaitable[T], timeout: float = 240) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))  # type: ignore[arg-type]


class RecordingTables(InProcessTables):
    """In-process tables that remember every deployment state written to them, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, DeploymentState]] = []

    def set_deployment_state(self, model: str, state: DeploymentState) -> None:
        self.writes.append((model, DeploymentState(state)))
        super().set_deployment_state(model, state)


def test_the_control_plane_writes_each_state_change_and_the_gateway_reports_it(
        tmp_path: Path, example_copy: Callable[..., Path], until: Callable[..., Any]) -> None:
    registry = LocalRegistry(tmp_path / "registry")
    push_package(example_copy(tmp_path / "pkg", prewarm=True, scale_down_delay=SCALE_DOWN_DELAY), registry)
    tables = RecordingTables()

    def states() -> list[DeploymentState]:
        return [state for model, state in tables.writes if model == MODEL]

    async def scenario() -> None:
        plane = make_plane(tmp_path, registry, tables)
        app = create_app(plane, authenticator=None)  # the gateway's /models/NAME/info over this plane
        await plane.start()
        gateway = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=30)

        async def info_state() -> str:
            response = await gateway.get(f"/models/{MODEL}/info")
            assert response.status_code == 200, response.text
            assert response.json()["state_source"] == "routing tables"
            return response.json()["state"]

        try:
            deploying = asyncio.create_task(plane.deploy(MODEL))  # prewarmed: one replica starts
            await until(lambda: states() == [STARTING], 30, "starting while the replica loads")
            assert await info_state() == "starting"
            dep = await deploying
            await until(lambda: states() == [STARTING, WARM], 10, "warm once the replica is ready")
            assert await info_state() == "warm"
            # Idle for the scale-down delay (2 s): the replica sleeps, then after another delay it stops.
            await until(lambda: states()[-1:] == [SLEEPING], 30, "sleeping")
            assert await info_state() == "sleeping"
            await until(lambda: states()[-1:] == [COLD] and not dep.replicas, 60, "cold: scaled to zero")
            assert await info_state() == "cold"
            # A request for the cold deployment starts a replica again.
            assert await plane.acquire(MODEL)
            await until(lambda: states()[-1:] == [WARM], 10, "warm again after the cold start")
            await plane.delete(MODEL)
            await until(lambda: states()[-1:] == [COLD], 10, "cold once deleted")
            assert states() == [STARTING, WARM, SLEEPING, COLD, STARTING, WARM, COLD]  # each change once
            assert tables.deployment_state(MODEL) is COLD
        finally:
            await gateway.aclose()
            await plane.shutdown()

    run(scenario())


class ReadOnlyRedisTables(RedisTables):
    """The second control plane's tables: it must never write the model's state (it runs no replica of it)."""

    def set_deployment_state(self, model: str, state: DeploymentState) -> None:
        raise AssertionError(f"the plane without replicas wrote {model}: {state}")


def test_a_second_control_plane_reads_the_first_ones_state_from_redis(
        tmp_path: Path, own_redis: Any, example_copy: Callable[..., Path], until: Callable[..., Any]) -> None:
    registry = LocalRegistry(tmp_path / "registry")
    push_package(example_copy(tmp_path / "pkg", prewarm=True, scale_down_delay=SCALE_DOWN_DELAY), registry)
    cold_registry = LocalRegistry(tmp_path / "cold-registry")  # the same model, scaled to zero and not prewarmed
    push_package(example_copy(tmp_path / "cold-pkg", prewarm=False, scale_down_delay=SCALE_DOWN_DELAY), cold_registry)
    first_tables = RedisTables.from_url(own_redis.url)   # the namespace the replicas publish to
    second_tables = ReadOnlyRedisTables.from_url(own_redis.url)

    async def scenario() -> None:
        # The first runs the replica (which publishes itself to Redis); the second, with its own packages dir and
        # the same package, runs none: it is scaled to zero and stays so, as gateway B of bench_routing.py.
        first = make_plane(tmp_path / "first", registry, first_tables, redis_url=own_redis.url)
        second = make_plane(tmp_path / "second", cold_registry, second_tables, redis_url=own_redis.url)
        await first.start()
        await second.start()
        seen: list[str] = []

        async def watch() -> None:  # what the second plane reports, as its gateway's /info would
            dep = await until(lambda: MODEL in second.names() and second.get(MODEL), 60, "the second deployment")
            while True:
                state, source = await second.deployment_state(dep)
                assert source == "routing tables"
                if not seen or seen[-1] != state:
                    seen.append(str(state))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            second_dep = await second.deploy(MODEL)
            await until(lambda: seen == ["cold"], 10, "cold before anything runs")  # derived: no replica yet
            dep = await first.deploy(MODEL)
            assert [r.state for r in dep.replicas] == ["ready"]
            await until(lambda: seen[-1:] == ["warm"], 10, "the second plane to read warm")
            await until(lambda: seen[-1:] == ["sleeping"], 30, "the second plane to read sleeping")
            await until(lambda: seen[-1:] == ["cold"] and not dep.replicas, 60, "the second plane to read cold")
            assert seen == ["cold", "starting", "warm", "sleeping", "cold"], seen
            assert second_dep.replicas == []
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await second.shutdown()
            await first.shutdown()
            first_tables.close()
            second_tables.close()

    run(scenario())
