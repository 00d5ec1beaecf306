"""The control plane on its own: a local registry, the blob cache, and real replica processes started by the
LocalProcessLauncher (no gateway)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ember.registry import BlobCache, LocalRegistry, push_package
from ember_platform.control.deployments import ReplicaState
from ember_platform.control.plane import (
    Conflict,
    ControlPlane,
    DeployError,
    DeploymentNotFound,
    InvalidDeployment,
    NoReplicaAvailable,
    VersionNotFound,
)
from ember_plugins.launchers.local import LocalProcessLauncher

T = TypeVar("T")
TOO_SMALL_KV = {"kv_cache_memory_gb": "1e-9"}  # passes every check a deploy makes; the engine refuses it at load

pytestmark = pytest.mark.usefixtures("one_thread_per_replica")


def run(coro: Awaitable[T], timeout: float = 180) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))  # type: ignore[arg-type]


@pytest.fixture
def registry(tmp_path: Path, example_copy: Callable[..., Path]) -> LocalRegistry:
    registry = LocalRegistry(tmp_path / "registry")
    # No prewarm: deploying it starts nothing until a request comes.
    push_package(example_copy(tmp_path / "pkg", prewarm=False), registry)
    push_package(tmp_path / "pkg", registry, version="0.2.0")
    return registry


def make_plane(tmp_path: Path, registry: LocalRegistry, packages: str = "packages") -> ControlPlane:
    return ControlPlane(registry, packages_dir=tmp_path / packages, cache=BlobCache(tmp_path / "cache"),
                        launcher=LocalProcessLauncher(log_dir=tmp_path / "logs", drain_timeout=5),
                        probe_interval=0.2)


def test_a_version_is_pulled_once_through_the_blob_cache(tmp_path: Path, registry: LocalRegistry) -> None:
    async def scenario() -> None:
        first = make_plane(tmp_path, registry)
        await first.start()
        dep = await first.deploy("tiny-llama:0.1.0")
        pull = dep.active.pull
        assert dep.active.package_dir == tmp_path / "packages" / "tiny-llama" / "0.1.0"
        assert (dep.active.package_dir / "ember.lock").is_file()
        assert not pull.reused and pull.blobs_downloaded > 0 and pull.downloaded_bytes > 7_000_000
        assert dep.replicas == [] and dep.desired == 0  # scaled to zero: nothing started
        await first.shutdown()

        again = make_plane(tmp_path, registry)  # the same packages dir: nothing to pull
        await again.start()
        assert (await again.deploy("tiny-llama:0.1.0")).active.pull.reused
        await again.shutdown()

        fresh = make_plane(tmp_path, registry, packages="packages-2")  # a new dir, the same blob cache
        await fresh.start()
        pull = (await fresh.deploy("tiny-llama")).active.pull
        assert not pull.reused and pull.blobs_downloaded == 0 and pull.blobs_from_cache > 0
        await fresh.shutdown()

    run(scenario())


def test_versions_promote_and_rollback_are_checked(tmp_path: Path, registry: LocalRegistry) -> None:
    async def scenario() -> None:
        plane = make_plane(tmp_path, registry)
        await plane.start()
        try:
            dep = await plane.deploy("tiny-llama:0.1.0")
            with pytest.raises(Conflict, match="no earlier version"):
                await plane.rollback("tiny-llama")
            await plane.deploy("tiny-llama:0.2.0")
            assert (dep.active_version, dep.history) == ("0.2.0", ["0.1.0"])
            with pytest.raises(VersionNotFound, match=r"ember deploy tiny-llama:0\.3\.0"):
                await plane.promote("tiny-llama", "0.3.0")
            await plane.rollback("tiny-llama")
            assert (dep.active_version, dep.history) == ("0.1.0", [])
            await plane.promote("tiny-llama", "0.2.0")
            assert (dep.active_version, dep.history) == ("0.2.0", ["0.1.0"])
            with pytest.raises(DeploymentNotFound, match="tiny-llama"):
                plane.get("other")
            await plane.delete("tiny-llama")
            assert plane.names() == []
        finally:
            await plane.shutdown()

    run(scenario())


def test_cold_start_then_a_dead_replica_is_replaced_and_delete_stops_it(tmp_path: Path, until: Callable[..., Any],
                                                                        registry: LocalRegistry) -> None:
    async def scenario() -> None:
        plane = make_plane(tmp_path, registry)
        await plane.start()
        try:
            dep = await plane.deploy("tiny-llama:0.1.0")
            # The first request starts a replica; one that cannot wait long enough gets a retry hint.
            with pytest.raises(NoReplicaAvailable) as caught:
                await plane.acquire("tiny-llama", timeout=0.1)
            assert caught.value.retry_after and "starting" in caught.value.message
            [replica] = await plane.acquire("tiny-llama")
            assert replica.state is ReplicaState.READY and dep.desired == 1
            assert replica.url and replica.url.startswith("http://127.0.0.1:")

            assert replica.handle is not None and replica.handle.pid is not None
            os.kill(replica.handle.pid, signal.SIGKILL)
            [replacement] = await until(lambda: [r for r in dep.ready_replicas() if r is not replica], 60,
                                        "a replacement replica")
            assert replica.state is ReplicaState.DEAD and replica not in dep.replicas
            assert any(f"replica {replica.id} (0.1.0) exited by itself (code -9)" in e for e in dep.events)

            # Overrides a replica would refuse are refused at once (400), before any replica starts.
            with pytest.raises(InvalidDeployment, match="unknown engine option 'no_such_option'"):
                await plane.deploy("tiny-llama:0.2.0", overrides={"no_such_option": "1"})
            with pytest.raises(InvalidDeployment, match=r"tensor_parallel.*not supported yet"):
                await plane.deploy("tiny-llama:0.2.0", overrides={"parallelism": "none", "tensor_parallel": "2"})
            # A new version whose replicas cannot start (a KV cache too small for one sequence) changes nothing.
            with pytest.raises(DeployError, match="KV cache holds"):
                await plane.deploy("tiny-llama:0.2.0", overrides=TOO_SMALL_KV)
            assert dep.active_version == "0.1.0" and dep.overrides == {} and sorted(dep.versions) == ["0.1.0"]
            assert dep.ready_replicas() == [replacement]

            assert replacement.handle is not None
            await plane.delete("tiny-llama")
            assert replacement.handle.process.returncode == 0  # drained, then exited by itself
            with pytest.raises(DeploymentNotFound):
                await plane.acquire("tiny-llama")
        finally:
            await plane.shutdown()

    run(scenario())


def test_a_first_deploy_that_cannot_start_leaves_nothing_behind(tmp_path: Path, registry: LocalRegistry) -> None:
    async def scenario() -> None:
        plane = make_plane(tmp_path, registry)
        await plane.start()
        try:
            with pytest.raises(DeployError) as caught:
                await plane.deploy("tiny-llama:0.1.0", min_replicas=1, overrides=TOO_SMALL_KV)
            message = str(caught.value)
            assert "before it was ready" in message and "last lines of" in message and "KV cache holds" in message
            assert plane.names() == []
        finally:
            await plane.shutdown()

    run(scenario())
