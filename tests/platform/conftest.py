"""Helpers shared by the platform tests that run real replica processes from the example package.

pytest's importlib mode lets no test module import a conftest, so they are handed out as fixtures
(`example_copy`, `until`, `one_thread_per_replica`), as tests/conftest.py hands out `start_moto`."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"


def _toml_value(value: bool | int | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int) else f'"{value}"'


def copy_example(dest: Path, *, lock: bool = True, adapters: Path | None = None, manifest_extra: str = "",
                 **settings: bool | int | str) -> Path:
    """The example package copied to `dest`, each `settings` key's line of its ember.toml set to the value
    (e.g. prewarm=False, scale_down_delay="2s"); without its ember.lock unless `lock`; `adapters` (a folder)
    copied in as adapters/; `manifest_extra` (e.g. `[[lora]]` entries) appended to the manifest."""
    ignore = ("__pycache__",) if lock else ("__pycache__", "ember.lock")
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns(*ignore))
    if adapters is not None:
        shutil.copytree(adapters, dest / "adapters")
    manifest = dest / "ember.toml"
    text = manifest.read_text()
    for key, value in settings.items():
        text, found = re.subn(rf"(?m)^{key} = .*$", f"{key} = {_toml_value(value)}", text)
        if found != 1:
            raise KeyError(f"{manifest}: expected one '{key} = ...' line, found {found}")
    manifest.write_text(text + manifest_extra)
    return dest


async def until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Await the predicate's first true value, polling on the running loop; AssertionError naming `what` after
    `timeout` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if value := predicate():
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(name="example_copy", scope="session")
def example_copy_fixture() -> Callable[..., Path]:
    """copy_example(dest, *, lock=True, adapters=None, manifest_extra="", **settings) -> dest."""
    return copy_example


@pytest.fixture(name="until", scope="session")
def until_fixture() -> Callable[..., Any]:
    """await until(predicate, timeout, what, interval=0.05) -> the predicate's first true value."""
    return until


@pytest.fixture
def one_thread_per_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica processes started by the test use one torch thread each: several share this machine's cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


async def launch_replica(launcher: Any, spec: Any, timeout: float = 120.0) -> Any:
    """Start `spec` with `launcher` (ember.launch) and wait until it runs; its handle. Raises when it exits first."""
    from ember.launch import LaunchState

    handle = await launcher.start(spec)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (status := await launcher.status(handle)).state is LaunchState.STARTING:
        if loop.time() > deadline:
            await launcher.stop(handle, 0)
            raise AssertionError(f"{spec.label} was not running within {timeout:.0f} s")
        await asyncio.sleep(0.05)
    if status.state is LaunchState.EXITED:
        raise AssertionError(f"{spec.label} exited: {status.reason}")
    return handle


def replica_spec(registry: Any, package_dir: Path, **fields: Any) -> Any:
    """A ReplicaSpec for the package pushed from `package_dir` to `registry` (pushed now), as the control plane makes
    one: registry reference and digest, a fresh secret."""
    import uuid

    from ember.launch import ReplicaSpec
    from ember.registry import push_package
    from ember_platform.replica.auth import new_secret

    lock = push_package(package_dir, registry).lock
    return ReplicaSpec(**{"deployment": lock.name, "version": lock.version, "digest": lock.digest,
                          "registry_url": registry.url, "replica_id": uuid.uuid4().hex[:8], "secret": new_secret(),
                          **fields})


@pytest.fixture(name="launch_replica", scope="session")
def launch_replica_fixture() -> Callable[..., Any]:
    """await launch_replica(launcher, spec, timeout=120) -> the launcher's handle, once the replica runs."""
    return launch_replica


@pytest.fixture(name="replica_spec", scope="session")
def replica_spec_fixture() -> Callable[..., Any]:
    """replica_spec(registry, package_dir, **fields) -> a ReplicaSpec of the package, pushed to `registry` now."""
    return replica_spec
