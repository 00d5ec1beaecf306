"""Replicas obey only their gateway: a replica process started the way the gateway starts it (the real
LocalProcessLauncher) refuses every call but its probes without the secret the launcher handed it, and a replica
started by hand without one makes one up rather than run open."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ember.registry import LocalRegistry
from ember_platform.replica.auth import SECRET_ENV, SECRET_FILE, auth_headers, cluster_secret
from ember_plugins.launchers.local import LocalProcessLauncher

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
COMPLETION = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 1}
PROTECTED = [("POST", "/v1/completions", COMPLETION),
             ("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}]}),
             ("POST", "/sleep", None), ("POST", "/wake", None), ("GET", "/info", None)]


@dataclass(frozen=True)
class Launched:
    url: str
    pid: int
    secret: str


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, example_copy: Callable[..., Path],
             replica_spec: Callable[..., Any], launch_replica: Callable[..., Any]) -> Iterator[Launched]:
    """One replica started by the launcher the gateway uses, with one torch thread (the machine's cores are shared)."""
    root = tmp_path_factory.mktemp("auth")
    spec = replica_spec(LocalRegistry(root / "registry"), example_copy(root / "pkg"))
    launcher = LocalProcessLauncher(log_dir=root / "logs", drain_timeout=5, threads=1)
    loop = asyncio.new_event_loop()
    handle = loop.run_until_complete(launch_replica(launcher, spec))
    try:
        yield Launched(handle.url, handle.pid, spec.secret)
    finally:
        loop.run_until_complete(launcher.stop(handle, 0))
        loop.close()


def _assert_refused(response: httpx.Response, code: str = "invalid_replica_secret") -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == code
    assert "Error" not in error["message"] and "Traceback" not in response.text
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_a_local_process_without_the_secret_is_refused(launched: Launched, method: str, path: str,
                                                       body: dict | None) -> None:
    for headers in ({}, {"Authorization": "Bearer not-the-secret"}, {"Authorization": f"Basic {launched.secret}"},
                    {"Authorization": f"Bearer {launched.secret}x"}):
        _assert_refused(httpx.request(method, f"{launched.url}{path}", json=body, headers=headers, timeout=30))


def test_the_secret_travels_in_the_environment_never_in_argv(launched: Launched) -> None:
    assert launched.secret and len(launched.secret) >= 32
    assert launched.secret.encode() not in Path(f"/proc/{launched.pid}/cmdline").read_bytes()
    assert f"{SECRET_ENV}={launched.secret}".encode() in Path(f"/proc/{launched.pid}/environ").read_bytes()


def test_probes_stay_open_and_the_secret_opens_everything_else(launched: Launched) -> None:
    assert httpx.get(f"{launched.url}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{launched.url}/ready", timeout=10).status_code == 200
    assert "ember_requests_finished_total" in httpx.get(f"{launched.url}/metrics", timeout=10).text

    client = openai.OpenAI(base_url=f"{launched.url}/v1", api_key=launched.secret, max_retries=0, timeout=60)
    assert client.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=2).usage.completion_tokens == 2
    headers = auth_headers(launched.secret)
    assert httpx.get(f"{launched.url}/info", headers=headers, timeout=10).json()["name"] == "tiny-llama"
    assert httpx.post(f"{launched.url}/sleep", headers=headers, timeout=30).json() == {"status": "sleeping"}
    assert httpx.post(f"{launched.url}/wake", headers=headers, timeout=30).status_code == 200
    assert client.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=1).choices[0].text is not None


def test_a_replica_started_by_hand_without_a_secret_makes_one_up(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    log = tmp_path / "replica.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ember_platform.replica", "--package", str(EXAMPLE),
                                 "--port", "0", "--threads", "1", "--log-level", "warning"],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        url = ""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not url:
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"the replica exited with {proc.wait()}:\n{log.read_text()}")
            if line.startswith("EMBER_REPLICA_READY "):
                url = line.split()[1]
        [secret_line] = [line for line in log.read_text().splitlines() if line.startswith("replica secret")]
        secret = secret_line.rsplit(" ", 1)[1]
        _assert_refused(httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30))
        response = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=auth_headers(secret), timeout=30)
        assert response.status_code == 200, response.text
    finally:
        proc.kill()
        proc.wait(timeout=15)


def test_the_cluster_secret_comes_from_the_environment_else_one_file_in_the_serve_home(tmp_path: Path) -> None:
    assert cluster_secret(None, {}) is None  # alone: each replica gets a fresh secret of its own
    assert cluster_secret(tmp_path, {SECRET_ENV: " chosen "}) == "chosen"
    assert not (tmp_path / SECRET_FILE).exists()
    made = cluster_secret(tmp_path, {})
    assert made and len(made) >= 32 and (tmp_path / SECRET_FILE).stat().st_mode & 0o777 == 0o600
    assert cluster_secret(tmp_path, {}) == made  # every gateway on this home, every start: the same one
