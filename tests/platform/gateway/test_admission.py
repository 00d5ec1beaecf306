"""Admission control and a replica's death, end to end: `ember serve` of two copies of the example package (real
gateway, real replica processes on loopback) with small capacities, so a handful of streams overload them.

shed-llama: max_num_seqs = 2 and max_queue = 2 (4 places), max_concurrency_per_key = 3.
slow-llama: max_num_seqs = 1 and max_queue = 1, queue_timeout = 1 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[3]
ADMIN_KEY = "ember-sk-admin-for-admission-tests"
SHED, SLOW = "shed-llama", "slow-llama"
READY_TIMEOUT_S = 180.0
LONG_TOKENS = 600  # a stream long enough to still run while the test overloads the model around it
LONGEST_TOKENS = 2000  # near the example's whole context: a request that must outlast a timeout


@dataclass
class Served:
    url: str
    keys: dict[str, str]
    home: Path
    process: subprocess.Popen[str]
    log: Path
    pids: set[int] = field(default_factory=set)

    def deployment(self, name: str) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/admin/deployments/{name}", headers=_auth(ADMIN_KEY), timeout=30)
        assert response.status_code == 200, response.text
        dep = response.json()
        self.pids.update(r["pid"] for r in dep["replicas"] if r["pid"])
        return dep

    def ready(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.deployment(name)["replicas"] if r["state"] == "ready"]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _ember(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def _wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, example_copy: Callable[..., Path],
           stop_serve: Callable[..., None], serve_ready_url: Callable[..., str]) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("admission")
    shed = example_copy(tmp / SHED, lock=False, name=SHED, max_num_seqs=2, max_replicas=1,
                        manifest_extra="\n[serving]\nmax_queue = 2\nmax_concurrency_per_key = 3\n")
    slow = example_copy(tmp / SLOW, lock=False, name=SLOW, max_num_seqs=1, max_replicas=1,
                        manifest_extra='\n[serving]\nmax_queue = 1\nqueue_timeout = "1s"\n')
    env = {**os.environ, "EMBER_HOME": str(tmp / "home"), "EMBER_REGISTRY": str(tmp / "registry"),
           "EMBER_CACHE": str(tmp / "cache"), "EMBER_ADMIN_KEY": ADMIN_KEY, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    keys = {}
    for name in ("alice", "bob"):
        created = _ember("keys", "create", "--name", name, env=env)
        assert created.returncode == 0, created.stderr
        keys[name] = created.stdout.strip()
    log = tmp / "serve.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(shed), str(slow), "--port", "0"],
                                   env=env, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO)
    server = Served("", keys, tmp / "home", process, log)
    try:
        server.url = serve_ready_url(process, log, READY_TIMEOUT_S)
        for name in (SHED, SLOW):
            _wait_until(lambda name=name: server.ready(name), READY_TIMEOUT_S, f"a ready replica of {name}")
        yield server
    finally:
        stop_serve(process, server.pids, server.home)




@dataclass
class Outcome:
    status: int
    headers: httpx.Headers
    events: list[str]  # the SSE events' data, in order (a streamed 200), or the error body (as one item)
    seconds: float     # from sending to the end of the response


def _stream(served: Served, model: str, key: str, max_tokens: int = LONG_TOKENS) -> Outcome:
    """One streamed completion, read to its end with httpx (every header and event as sent)."""
    body = {"model": model, "prompt": "def main():", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers=_auth(key), timeout=120) as r:
        if r.status_code != 200:
            return Outcome(r.status_code, r.headers, [r.read().decode()], time.monotonic() - started)
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        return Outcome(200, r.headers, events, time.monotonic() - started)


def _in_threads(calls: list[Callable[[], Outcome]]) -> tuple[list[threading.Thread], list[Outcome | None]]:
    results: list[Outcome | None] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    return threads, results


def _completed(outcome: Outcome | None, tokens: int = LONG_TOKENS) -> bool:
    if outcome is None or outcome.status != 200 or outcome.events[-1] != "[DONE]":
        return False
    chunks = [json.loads(e) for e in outcome.events[:-1]]
    return not any("error" in c for c in chunks) and sum(1 for c in chunks if c["choices"][0]["text"]) > 0


def _assert_refused(outcome: Outcome | None, status: int, code: str) -> dict[str, Any]:
    assert outcome is not None and outcome.status == status, outcome
    assert int(outcome.headers["retry-after"]) >= 1
    error = json.loads(outcome.events[0])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert "Error" not in error["message"] and "Traceback" not in error["message"]  # no Python class names
    return error


def _places_taken(served: Served, model: str, running: int, queued: int) -> bool:
    dep = served.deployment(model)
    return sum(r["in_flight"] for r in dep["replicas"]) == running and dep["waiting"] == queued


def test_beyond_running_capacity_and_queue_requests_get_429_at_once_and_the_admitted_complete(served: Served) -> None:
    alice, bob = served.keys["alice"], served.keys["bob"]
    # Four places (2 running + 2 waiting), taken by two keys (each under its limit of 3)...
    admitted, results = _in_threads([lambda k=k: _stream(served, SHED, k) for k in (alice, bob, alice, bob)])
    _wait_until(lambda: _places_taken(served, SHED, running=2, queued=2), 30, "2 running and 2 waiting")
    # ...so four more streams at once are all refused, at once, while the admitted ones still run.
    refused, refusals = _in_threads([lambda k=k: _stream(served, SHED, k) for k in (alice, bob, bob, bob)])
    for thread in refused:
        thread.join(30)
    for outcome in refusals:
        error = _assert_refused(outcome, 429, "overloaded")
        assert "max_queue = 2" in error["message"]
        assert outcome is not None and outcome.seconds < 2.0
    assert all(thread.is_alive() for thread in admitted[:2])  # the first two are still streaming
    for thread in admitted:
        thread.join(120)
    assert all(_completed(outcome) for outcome in results), results  # nothing admitted was dropped
    _wait_until(lambda: _places_taken(served, SHED, running=0, queued=0), 10, "every place given back")


def test_one_key_is_held_to_its_limit_while_another_still_gets_in(served: Served) -> None:
    alice, bob = served.keys["alice"], served.keys["bob"]
    held, results = _in_threads([lambda: _stream(served, SHED, alice) for _ in range(3)])
    _wait_until(lambda: _places_taken(served, SHED, running=2, queued=1), 30, "alice's 3 requests admitted")
    # A place is free in the queue, but not for alice: she holds her 3 (max_concurrency_per_key).
    error = _assert_refused(_stream(served, SHED, alice), 429, "overloaded")
    assert "max_concurrency_per_key = 3" in error["message"]
    # bob takes that place and is served.
    [bobs], bob_result = _in_threads([lambda: _stream(served, SHED, bob, max_tokens=8)])
    for thread in [*held, bobs]:
        thread.join(120)
    assert all(_completed(outcome) for outcome in results), results
    assert _completed(bob_result[0], tokens=8), bob_result


def test_clients_that_leave_while_queued_or_mid_stream_give_their_places_back(served: Served) -> None:
    alice, bob = served.keys["alice"], served.keys["bob"]
    body = {"model": SHED, "prompt": "def main():", "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}  # about as long as the model's context allows: the streams run a second or more
    with httpx.Client(base_url=served.url, timeout=60) as client:
        streams = [client.stream("POST", "/v1/completions", json=body, headers=_auth(k)) for k in (alice, bob)]
        running = [s.__enter__() for s in streams]
        for response in running:
            assert response.status_code == 200
            next(response.iter_lines())
        # A third request waits for a place; its client gives up after 0.2 s, and its place in the queue goes.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{served.url}/v1/completions", json={**body, "stream": False}, headers=_auth(alice),
                       timeout=httpx.Timeout(60, read=0.2))
        _wait_until(lambda: served.deployment(SHED)["waiting"] == 0, 10, "the queued place given back")
        for stream in streams:  # both streaming clients leave mid-stream
            stream.__exit__(None, None, None)
    _wait_until(lambda: _places_taken(served, SHED, running=0, queued=0), 10, "the running places given back")
    # All four places are free again: four streams at once are all admitted.
    threads, results = _in_threads([lambda k=k: _stream(served, SHED, k, max_tokens=8) for k in (alice, bob) * 2])
    for thread in threads:
        thread.join(60)
    assert all(o is not None and o.status == 200 for o in results), results


def test_a_request_that_waits_longer_than_the_queue_timeout_gets_503_with_retry_after(served: Served) -> None:
    key = served.keys["alice"]
    # Near the model's whole context (2048): the running request must outlast the 1 s queue timeout by a margin
    # whatever the decode speed (600 tokens once finished inside it on a fast host, and the 503 never came).
    [running], result = _in_threads([lambda: _stream(served, SLOW, key, max_tokens=LONGEST_TOKENS)])
    _wait_until(lambda: _places_taken(served, SLOW, running=1, queued=0), 30, "the long request to run")
    waited = _stream(served, SLOW, served.keys["bob"], max_tokens=4)  # alice holds her default limit: half of 2
    _assert_refused(waited, 503, "service_unavailable")
    assert 0.9 < waited.seconds < 5.0  # queue_timeout = 1 s
    running.join(120)
    assert _completed(result[0], LONGEST_TOKENS), result


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_event_and_new_requests_wait_for_its_replacement(
        served: Served) -> None:
    key = served.keys["bob"]
    [victim] = served.ready(SHED)
    events: list[str] = []
    body = {"model": SHED, "prompt": "def main():", "max_tokens": 1500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers=_auth(key), timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line[len("data: "):])
        os.kill(victim["pid"], signal.SIGKILL)
        events += [line[len("data: "):] for line in lines if line.startswith("data: ")]  # ends without a read error
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "upstream_disconnected"

    # Requests sent while the replacement starts wait for it (as many as the queue holds: 2), and are answered.
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0, timeout=120)
    started = time.monotonic()
    outcomes: list[Any] = []

    def call() -> None:
        try:
            outcomes.append(client.completions.create(model=SHED, prompt="Hi", max_tokens=3))
        except openai.APIError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(outcomes) == 2 and all(not isinstance(o, Exception) for o in outcomes), outcomes
    assert all(o.usage.completion_tokens == 3 for o in outcomes)
    [replacement] = served.ready(SHED)
    assert replacement["id"] != victim["id"]
    assert time.monotonic() - started < 60


def test_ten_times_overload_is_shed_cleanly_and_health_stays_fast(served: Served, probe_health) -> None:
    """40 streams at once, 20x the model's running capacity (2) and 10x its places (4), in waves for ~10 s: every
    request gets a whole answer, or a 429 or 503 with Retry-After; none is lost; /health stays fast."""
    import asyncio

    keys = list(served.keys.values())

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, bool, bool]:
        body = {"model": SHED, "prompt": "def main():", "max_tokens": 16, "temperature": 0, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body, headers=_auth(keys[i % 2])) as r:
            if r.status_code != 200:
                error = json.loads(await r.aread())["error"]
                return r.status_code, "retry-after" in r.headers, set(error) == {"message", "type", "param", "code"}
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return 200, True, events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)

    async def main() -> list[tuple[int, bool, bool]]:
        outcomes = []
        async with httpx.AsyncClient(base_url=served.url, timeout=60, limits=httpx.Limits(max_connections=None)) \
                as client:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                outcomes += await asyncio.gather(*(one(client, i) for i in range(40)))
        return outcomes

    # /health is timed from another process: this one's event loop is busy with 40 streams (its lag is not the
    # gateway's).
    with probe_health(served.url, 0.05) as probe:
        outcomes = asyncio.run(main())
    statuses = {status for status, _, _ in outcomes}
    assert statuses <= {200, 429, 503}, statuses                   # no other 5xx (nor 4xx)
    assert all(has_retry for status, has_retry, _ in outcomes if status != 200)  # every refusal says when to retry
    assert all(whole for _, _, whole in outcomes)                  # whole answers, OpenAI error objects
    assert sum(status == 200 for status, _, _ in outcomes) >= 4    # the admitted were served...
    assert sum(status == 429 for status, _, _ in outcomes) > len(outcomes) / 2  # ...the excess shed
    assert probe.quantile(0.99) < 0.1, probe.latencies[-5:]
    answer = openai.OpenAI(base_url=f"{served.url}/v1", api_key=keys[0], max_retries=0, timeout=60)\
        .completions.create(model=SHED, prompt="Hi", max_tokens=3)  # a normal request right after
    assert answer.usage is not None and answer.usage.completion_tokens == 3
