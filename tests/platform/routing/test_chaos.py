"""Chaos under streaming load, all real processes: `ember serve --redis-url` (real redis-server) with its registry and
its replicas' KV tier in S3 (a moto server), while a few clients stream chat and completion requests in a loop. One
after the other: a replica is killed with SIGKILL, Redis is restarted, the S3 endpoint is stopped. Each time no request
hangs, each gets a complete answer or a clean error (4xx, or 503 with Retry-After, as an OpenAI error object; or an
SSE error event followed by [DONE]), and a normal request succeeds afterwards."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
MODEL = "tiny-llama"
ADMIN_KEY = "ember-sk-admin-for-chaos"
CLIENTS = 3  # concurrent streams, each in a loop
REQUEST_BOUND_S = 30.0  # "no hang": every request ends, one way or another, within this
PHASE_S = 4.0  # load kept up after each fault before the service must have recovered
RECOVERY_S = 30.0  # a normal request must succeed within this after each fault
# Shared prefixes over several KV blocks, so replicas write blocks to the S3 tier and fetch those others wrote.
PREFIXES = ["def fibonacci(n):\n    " * 6, "import os\nimport sys\n" * 8, "class Stack:\n    def push(self, x):\n" * 5]


@dataclass
class Outcome:
    phase: str
    kind: str  # "complete" | "clean error" | "bad"
    detail: str
    seconds: float


def _error_object(raw: bytes) -> dict[str, Any] | None:
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error if isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys() else None


def _one_request(http: httpx.Client, url: str, rng: random.Random, phase: str) -> Outcome:
    chat = rng.random() < 0.5
    prompt = rng.choice(PREFIXES) + f"# {rng.randrange(10**6)}\n"
    # Long enough that a replica killed at any moment has streams in flight to cut.
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "ignore_eos": True, "stream": True, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    start = time.monotonic()

    def outcome(kind: str, detail: str) -> Outcome:
        return Outcome(phase, kind, detail, time.monotonic() - start)

    try:
        with http.stream("POST", f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body) as r:
            if r.status_code != 200:
                raw = r.read()
                error = _error_object(raw)
                retry_after = r.headers.get("Retry-After")
                retry_ok = r.status_code != 429 or retry_after is not None
                clean = error is not None and ((r.status_code == 503 and retry_after is not None)
                                               or (400 <= r.status_code < 500 and retry_ok))
                return outcome("clean error" if clean else "bad", f"HTTP {r.status_code}: {raw[:200]!r}")
            finished = done = False
            error_event: dict[str, Any] | None = None
            for line in r.iter_lines():
                if not line:
                    continue
                if done:
                    return outcome("bad", f"data after [DONE]: {line[:200]}")
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line.removeprefix("data: "))
                if error_event is not None:
                    return outcome("bad", f"an event after the error event: {line[:200]}")
                if "error" in event:
                    error_event = event["error"]
                    continue
                finished |= any(c.get("finish_reason") for c in event.get("choices", []))
            if not done:
                return outcome("bad", "the stream ended without [DONE]")
            if error_event is not None:
                return outcome("clean error", f"SSE error event: {error_event.get('message', '')[:200]}")
            return outcome("complete" if finished else "bad", "" if finished else "[DONE] without a finish_reason")
    except httpx.TimeoutException as e:
        return outcome("bad", f"hung: {type(e).__name__} after {time.monotonic() - start:.1f} s")
    except (httpx.HTTPError, ValueError) as e:  # a cut chunked body, a reset connection, a broken event
        return outcome("bad", f"{type(e).__name__}: {e}")


class Load:
    """CLIENTS threads streaming requests through the gateway in a loop; each outcome is recorded under the phase
    that was current when its request ended."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.phase = "steady"
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        timeout = httpx.Timeout(REQUEST_BOUND_S, connect=5.0)
        with httpx.Client(timeout=timeout) as http:
            while not self._stop.is_set():
                outcome = _one_request(http, self.url, rng, self.phase)
                outcome.phase = self.phase  # the phase it ended in: a stream cut by a fault counts under that fault
                self.outcomes.append(outcome)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_BOUND_S + 5)
        assert not any(t.is_alive() for t in self._threads), "a client thread hung past the request bound"

    def by_phase(self) -> dict[str, Counter[str]]:
        table: dict[str, Counter[str]] = {}
        for o in list(self.outcomes):
            table.setdefault(o.phase, Counter())[o.kind] += 1
        return table


def _ember(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def _admin(url: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120,
                         **kwargs)


def _ready_replicas(url: str) -> list[dict[str, Any]]:
    response = _admin(url, "GET", f"/admin/deployments/{MODEL}")
    assert response.status_code == 200, response.text
    return [r for r in response.json()["replicas"] if r["state"] == "ready"]


def _busy_replica(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """A ready replica with streams in flight (the one to kill: killing an idle one cuts nothing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [r for r in _ready_replicas(url) if r["in_flight"] and r["pid"]]
        if busy:
            return busy[0]
        time.sleep(0.01)
    raise AssertionError(f"no replica had a request in flight within {timeout:.0f} s")


def _recovered(url: str, deadline_s: float = RECOVERY_S) -> float:
    """Seconds until a normal (unstreamed) request succeeds, or AssertionError after `deadline_s`."""
    start = time.monotonic()
    last = ""
    while time.monotonic() - start < deadline_s:
        try:
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "def add(a, b):",
                                                           "max_tokens": 4}, timeout=REQUEST_BOUND_S)
            if r.status_code == 200 and r.json()["choices"][0]["finish_reason"]:
                return time.monotonic() - start
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.2)
    raise AssertionError(f"no normal request succeeded within {deadline_s:.0f} s; last: {last}")


@dataclass
class Chaos:
    url: str
    redis: Any
    moto: Any
    bucket: str
    pids: set[int]


@pytest.fixture
def chaos(own_redis: Any, start_moto: Callable[..., Any], tmp_path: Path, aws_sandbox: None,
          example_copy: Callable[..., Path], stop_serve: Callable[..., None]) -> Iterator[Chaos]:
    """`ember serve --redis-url --registry s3://...` with tiny-llama deployed on 2 replicas whose KV tier is in S3."""
    moto = start_moto(tmp_path / "moto.log")
    bucket = moto.new_bucket("ember-chaos")
    home = tmp_path / "home"
    env = {**os.environ, "EMBER_HOME": str(home), "EMBER_CACHE": str(tmp_path / "cache"), "EMBER_ADMIN_KEY": ADMIN_KEY,
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "AWS_ENDPOINT_URL": moto.url}
    registry = f"s3://{bucket}/registry"
    package = example_copy(tmp_path / "pkg", lock=False, min_replicas=2, max_replicas=2, target_concurrency=1000)
    pushed = _ember(env, "push", str(package), "--registry", registry)
    assert pushed.returncode == 0, pushed.stderr
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", "--no-auth", "--host", "127.0.0.1",
                                    "--port", "0", "--registry", registry, "--redis-url", own_redis.url], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=out, text=True, cwd=REPO)
    pids: set[int] = set()
    try:
        assert process.stdout is not None
        url = ""
        for line in process.stdout:  # the ready line comes within seconds (no package to deploy yet)
            if line.startswith("EMBER_SERVE_READY "):
                url = line.split()[1].rstrip("/")
                break
        assert url, f"ember serve did not start:\n{log.read_text()[-3000:]}"
        threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()  # keep the pipe drained
        kv_tiers = {"cpu_gb": 0.01, "s3_url": f"s3://{bucket}/kv", "s3_endpoint_url": moto.url}
        deployed = _admin(url, "POST", "/admin/deployments", json={"reference": MODEL, "min_replicas": 2,
                                                                  "overrides": {"kv_tiers": json.dumps(kv_tiers)}})
        assert deployed.status_code in (200, 201), deployed.text
        deadline = time.monotonic() + 60
        while len(ready := _ready_replicas(url)) < 2:
            assert time.monotonic() < deadline, f"2 replicas not ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        pids.update(r["pid"] for r in ready if r["pid"])
        yield Chaos(url, own_redis, moto, bucket, pids)
    finally:
        stop_serve(process, pids, home)
        moto.stop()


def test_kill_a_replica_restart_redis_stop_s3_under_streaming_load(chaos: Chaos) -> None:
    started = time.monotonic()
    recovery: dict[str, float] = {}
    with Load(chaos.url) as load:
        time.sleep(PHASE_S)

        load.phase = "replica killed"
        victim = _busy_replica(chaos.url)
        os.kill(victim["pid"], signal.SIGKILL)
        time.sleep(PHASE_S)
        recovery["replica killed"] = _recovered(chaos.url)
        deadline = time.monotonic() + RECOVERY_S
        while len(ready := _ready_replicas(chaos.url)) < 2:  # the control plane replaces it
            assert time.monotonic() < deadline, "the killed replica was not replaced"
            time.sleep(0.2)
        chaos.pids.update(r["pid"] for r in ready if r["pid"])

        load.phase = "redis restarted"
        chaos.redis.kill()
        time.sleep(1.0)
        chaos.redis.start()
        time.sleep(PHASE_S)
        recovery["redis restarted"] = _recovered(chaos.url)

        kv_objects = chaos.moto.client().list_objects_v2(Bucket=chaos.bucket, Prefix="kv/")["KeyCount"]
        assert kv_objects, "the replicas wrote no KV blocks to S3: stopping it would test nothing"
        load.phase = "s3 stopped"
        chaos.moto.stop()
        time.sleep(PHASE_S)
        recovery["s3 stopped"] = _recovered(chaos.url)
        load.phase = "after"
        time.sleep(1.0)

    table = load.by_phase()
    bad = [o for o in load.outcomes if o.kind == "bad"]
    slowest = max(o.seconds for o in load.outcomes)
    summary = (f"outcomes by phase: { {p: dict(c) for p, c in table.items()} }; recovery s: {recovery}; "
               f"slowest request {slowest:.1f} s; total {time.monotonic() - started:.0f} s")
    errors = [f"{o.phase}: {o.detail}" for o in load.outcomes if o.kind == "clean error"]
    summary += f"; clean errors: {errors[:5]}"
    print(summary)
    assert all(table.get(p, {}).get("complete") for p in ("steady", "replica killed", "redis restarted",
                                                          "s3 stopped")), summary
    assert slowest < REQUEST_BOUND_S, summary
    # A stream the SIGKILL cuts must end with an SSE error event and [DONE] (gateway/proxy.py, issue 13 item 9):
    # before that, it ended as a broken chunked body, which is "bad" here.
    assert not bad, summary + "\n" + "\n".join(f"{o.phase}: {o.detail}" for o in bad[:10])
