"""A replica whose engine dies is stopped and reaped, never leaked: the replica process exits by itself (code 1), and
the control plane buries it and starts a replacement. The engine dies for real, inside `step()`: the package's
hooks.py breaks its model once a trigger prompt reaches it (every forward pass raises from then on, as on a lost
device), and after a few failed forward passes in a row the engine gives up (engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.registry import BlobCache, LocalRegistry, push_package
from ember_platform.control.plane import ControlPlane
from ember_platform.replica.auth import auth_headers
from ember_plugins.launchers.local import LocalProcessLauncher, LocalReplica

pytestmark = pytest.mark.usefixtures("one_thread_per_replica")

TRIGGER = [4095, 4094, 4093, 4092]  # a prompt no test or warm-up sends otherwise
CRASH_HOOK = f'''

TRIGGER = {TRIGGER}


@hookimpl
def ember_model_loaded(manifest, model, hardware):
    """Tests: once the trigger prompt reaches the model, every forward pass raises."""
    broken = []

    def crash_on_trigger(module, args):
        ids = args[0].tolist()
        if broken or any(ids[i:i + len(TRIGGER)] == TRIGGER for i in range(len(ids))):
            broken.append(True)
            raise RuntimeError("injected engine crash")

    model.register_forward_pre_hook(crash_on_trigger)
'''
NORMAL = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 1}


def crashing_package(dest: Path, example_copy: Callable[..., Path], **settings: Any) -> Path:
    package = example_copy(dest, lock=False, **settings)
    (package / "hooks.py").write_text((package / "hooks.py").read_text() + CRASH_HOOK)
    return package


def crash(url: str, secret: str | None) -> httpx.Response:
    """Send the trigger, then requests until the replica says its engine died; the last answer."""
    response = httpx.post(f"{url}/v1/completions", json={**NORMAL, "prompt": TRIGGER}, headers=auth_headers(secret),
                          timeout=30)
    for _ in range(10):
        assert response.status_code in (500, 503), response.text
        assert "error" in response.json() and "Traceback" not in response.text
        if httpx.get(f"{url}/ready", timeout=10).json()["status"] == "failed":
            break
        response = httpx.post(f"{url}/v1/completions", json=NORMAL, headers=auth_headers(secret), timeout=30)
    return response


def crash_until_gone(url: str, secret: str | None) -> None:
    """`crash`, for a replica nothing holds open: it may exit (its engine dead) before its /ready is read."""
    with contextlib.suppress(httpx.TransportError):  # gone already: the control plane sees its process exit
        crash(url, secret)


def reaped(pid: int) -> bool:
    """Gone from the process table: neither running nor a zombie waiting for its parent."""
    return not Path(f"/proc/{pid}").exists()


def test_a_replica_exits_non_zero_once_its_engine_dies(tmp_path: Path, example_copy: Callable[..., Path],
                                                       replica_spec: Callable[..., Any],
                                                       launch_replica: Callable[..., Any]) -> None:
    spec = replica_spec(LocalRegistry(tmp_path / "registry"), crashing_package(tmp_path / "pkg", example_copy))

    async def scenario() -> None:
        launcher = LocalProcessLauncher(log_dir=tmp_path / "logs", drain_timeout=30)
        handle: LocalReplica = await launch_replica(launcher, spec)
        try:
            ok = await asyncio.to_thread(httpx.post, f"{handle.url}/v1/completions", json=NORMAL,
                                         headers=auth_headers(spec.secret), timeout=30)
            assert ok.status_code == 200, ok.text
            await asyncio.to_thread(crash_until_gone, handle.url, spec.secret)
            # Nobody stops it: it exits by itself, well before its 30 s drain timeout.
            code = await asyncio.wait_for(handle.process.wait(), 10)
            assert code == 1
            assert "injected engine crash" in handle.log_path.read_text()
        finally:
            await launcher.stop(handle, 0)

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_a_failed_replica_is_reaped_and_replaced_and_the_deployment_serves_again(
        tmp_path: Path, example_copy: Callable[..., Path], until: Callable[..., Any]) -> None:
    registry = LocalRegistry(tmp_path / "registry")
    push_package(crashing_package(tmp_path / "pkg", example_copy, min_replicas=1, max_replicas=1), registry)

    async def scenario() -> None:
        plane = ControlPlane(registry, packages_dir=tmp_path / "packages", cache=BlobCache(tmp_path / "cache"),
                             launcher=LocalProcessLauncher(log_dir=tmp_path / "logs", drain_timeout=30),
                             probe_interval=0.2)
        await plane.start()
        try:
            dep = await plane.deploy("tiny-llama")
            [replica] = dep.ready_replicas()
            assert replica.handle is not None and replica.handle.pid is not None
            pid = replica.handle.pid

            # A request stuck in flight (its body never ends) keeps the replica from exiting by itself: it is the
            # control plane that must stop it.
            stuck = socket.create_connection(httpx.URL(replica.url).netloc.decode().split(":"), timeout=30)
            stuck.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Authorization: Bearer {replica.secret}\r\nContent-Length: 1000\r\n\r\n{{".encode())
            crashed_at = time.monotonic()
            # The plane probes every 0.2 s and kills a failed replica after its grace: on a loaded machine that can
            # come before this thread reads /ready (connection refused), which is the behaviour under test.
            await asyncio.to_thread(crash_until_gone, replica.url, replica.secret)

            await until(lambda: reaped(pid) and replica not in dep.replicas, 15,
                        f"the failed replica (pid {pid}) to be reaped and buried")
            reaped_s = time.monotonic() - crashed_at
            [replacement] = await until(lambda: [r for r in dep.ready_replicas() if r is not replica], 60,
                                        "a replacement replica")
            replaced_s = time.monotonic() - crashed_at
            assert replacement.handle is not None and replacement.handle.pid != pid
            ok = await asyncio.to_thread(httpx.post, f"{replacement.url}/v1/completions", json=NORMAL,
                                         headers=auth_headers(replacement.secret), timeout=30)
            assert ok.status_code == 200, ok.text
            assert any(f"replica {replica.id} (0.1.0) failed: its engine stopped" in e for e in dep.events), \
                list(dep.events)
            assert "Error" not in (dep.last_error or "") and "Error" not in " ".join(dep.events)
            # Killed after the plane's grace (FAILED_GRACE_S), or exited 1 by itself: never a clean exit.
            assert replica.handle.process.returncode in (1, -9)
            stuck.close()
            print(f"failed replica reaped in {reaped_s:.2f} s, replacement ready in {replaced_s:.2f} s")
        finally:
            await plane.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 180))


def test_a_replica_that_keeps_failing_is_restarted_with_growing_backoff_and_requests_get_503_meanwhile(
        tmp_path: Path, example_copy: Callable[..., Path], until: Callable[..., Any]) -> None:
    """CrashLoopBackOff: each replacement's engine dies too. The first is replaced at once, then the waits double
    (1 s, 2 s with this policy), the admin view says so, and a request meanwhile gets a 503 with Retry-After at once
    (it does not wait for a replica that cannot come before the backoff ends)."""
    from ember_platform.control.backoff import BackoffPolicy
    from ember_platform.gateway.app import create_app

    registry = LocalRegistry(tmp_path / "registry")
    push_package(crashing_package(tmp_path / "pkg", example_copy, min_replicas=1, max_replicas=1), registry)
    policy = BackoffPolicy(base_s=1.0, max_s=8.0, reset_after_s=600.0)

    async def scenario() -> None:
        plane = ControlPlane(registry, packages_dir=tmp_path / "packages", cache=BlobCache(tmp_path / "cache"),
                             launcher=LocalProcessLauncher(log_dir=tmp_path / "logs", drain_timeout=30),
                             probe_interval=0.1, restart_backoff=policy)
        app = create_app(plane, authenticator=None)
        await plane.start()
        gateway = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=60)
        try:
            dep = await plane.deploy("tiny-llama")
            intervals = []
            for failures in (1, 2, 3):
                [replica] = await until(dep.ready_replicas, 60, f"a ready replica before failure {failures}")
                await asyncio.to_thread(crash_until_gone, replica.url, replica.secret)
                await until(lambda n=failures: dep.backoff.failures == n, 10, f"failure {failures} to be counted")
                failed_at = dep.backoff.last_failure_at  # wall clock, when the plane counted it
                assert failed_at is not None
                if failures == 3:  # backing off for 2 s: a request now is refused at once, and says when to retry
                    sent = time.monotonic()
                    refused = await gateway.post("/v1/completions", json=NORMAL)
                    assert refused.status_code == 503, refused.text
                    assert time.monotonic() - sent < 1.0
                    assert 1 <= int(refused.headers["retry-after"]) <= 2
                    assert "failed 3 times in a row" in refused.json()["error"]["message"]
                    admin = (await gateway.get("/admin/deployments/tiny-llama")).json()["restarts"]
                    assert admin["failures_in_a_row"] == 3 and admin["count"] == 2 and admin["backoff_s"] == 2.0
                    assert 0 < admin["next_restart_in_s"] <= 2.0 and admin["next_restart_at"] > time.time()
                    # The probe saw its /ready say failed, or (first) its process exit by itself.
                    assert admin["last_failure"] in (f"replica {replica.id}'s engine failed",
                                                     f"replica {replica.id} exited by itself (code 1)")
                await until(lambda old=replica: [r for r in dep.replicas if r is not old and not r.stopping], 15,
                            f"the replacement after failure {failures}")
                intervals.append(time.time() - failed_at)  # polling adds up to 50 ms: only ever longer
            print("restart intervals:", [f"{s:.2f}" for s in intervals])
            assert intervals[0] < 0.5, intervals             # the first failure is replaced at once
            assert 1.0 <= intervals[1] < 1.6, intervals     # then 1 s
            assert 2.0 <= intervals[2] < 2.6, intervals     # then 2 s
            assert dep.backoff.restarts == 3
            await until(dep.ready_replicas, 60, "the third replacement")
            ok = await gateway.post("/v1/completions", json=NORMAL)
            assert ok.status_code == 200, ok.text
            assert any("crash-loop backoff: 3 failures in a row; the next replica starts in 2.0 s" in e
                       for e in dep.events), list(dep.events)
        finally:
            await gateway.aclose()
            await plane.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 240))
