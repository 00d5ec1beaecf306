"""Routing and elasticity end to end, through real processes: a real `redis-server`, two gateways (`ember serve
--redis-url`) and replica processes of the example model, the official `openai` client.

The topology of bench/bench_routing.py: gateway A deploys the example package with replicas that publish their
heartbeats, loads, KV blocks and LoRA adapters to Redis; gateway B has its own copy of the package scaled to zero,
starts no replica, and routes to A's replicas through the shared tables. Each test starts its own (the scenarios
kill things), on its own Redis (`own_redis`), with the tables' default lease: a heartbeat every second, 3 s TTL.

Which replica served a request is read from the replicas themselves (`ember_requests_finished_total` on each
replica's /metrics); a request a gateway sent to a replica it could not reach and then sent elsewhere is counted by
the gateway (`ember_gateway_upstream_retries_total`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ember_platform.routing import ReplicaState
from ember_platform.routing.redis_tables import RedisTables

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-llama"
MODEL = "tiny-llama"
TTL_S = 3.0          # the replicas' lease (routing.publisher: 3 heartbeats of 1 s)
READY_TIMEOUT_S = 180.0
VOCAB = 4096


def package_copy(dest: Path, *, replicas: int) -> Path:
    """The example package with `replicas` replicas at deploy time (0: scaled to zero), no autoscaling."""
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("__pycache__", "ember.lock"))
    manifest = dest / "ember.toml"
    text = manifest.read_text()
    text = re.sub(r"(?m)^min_replicas = .*$", f"min_replicas = {replicas}", text)
    text = re.sub(r"(?m)^max_replicas = .*$", f"max_replicas = {max(1, replicas)}", text)
    text = re.sub(r"(?m)^prewarm = .*$", f"prewarm = {'true' if replicas else 'false'}", text)
    text = re.sub(r"(?m)^target_concurrency = .*$", "target_concurrency = 1000", text)
    manifest.write_text(text)
    return dest


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class Gateway:
    """`ember serve PACKAGE --redis-url URL` in a subprocess with its own home, registry and cache."""

    def __init__(self, name: str, package: Path, workdir: Path, redis_url: str) -> None:
        self.name = name
        self.package = package
        self.home = workdir / name / "home"
        self.log_path = workdir / name / "serve.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.redis_url = redis_url
        self.url = ""
        self.process: subprocess.Popen[str] | None = None
        self.pids: set[int] = set()
        self._lines: queue.Queue[str | None] = queue.Queue()

    def launch(self) -> Gateway:
        env = {**os.environ, "EMBER_HOME": str(self.home), "EMBER_REGISTRY": str(self.home.parent / "registry"),
               "EMBER_CACHE": str(self.home.parent / "cache"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "EMBER_ROUTING": "kv"}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ember", "serve", str(self.package), "--no-auth", "--host", "127.0.0.1",
                 "--port", "0", "--redis-url", self.redis_url], env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        return self

    def _read_stdout(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:  # keeps the pipe from filling up
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self) -> Gateway:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith("EMBER_SERVE_READY "):
                self.url = line.split()[1].rstrip("/")
                self.replicas()
                return self
        raise AssertionError(f"gateway {self.name} did not become ready:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def client(self, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=timeout)

    def replicas(self) -> list[dict[str, Any]]:
        """The replicas this gateway's control plane runs."""
        response = httpx.get(f"{self.url}/admin/deployments/{MODEL}", timeout=30)
        assert response.status_code == 200, response.text
        replicas = response.json()["replicas"]
        self.pids.update(r["pid"] for r in replicas if r["pid"])
        return replicas

    def info(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/models/{MODEL}/info", timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    def retries(self) -> float:
        """Requests this gateway sent to another replica after one could not be reached (or answered 503)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        match = re.search(r'^ember_gateway_upstream_retries_total\{model="tiny-llama"\} ([0-9.e+]+)$', text, re.M)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for pid in self.pids:  # a failed test must not leave replicas behind
            kill_if_ours(pid, self.home)


def kill_if_ours(pid: int, home: Path) -> None:
    """SIGKILL a replica of this gateway, and nothing else that may have taken its pid since."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return
    if "ember_platform.replica" in command and str(home) in command:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Topology:
    def __init__(self, a: Gateway, b: Gateway, redis_url: str) -> None:
        self.a, self.b = a, b
        self.tables = RedisTables.from_url(redis_url)  # what every gateway and replica shares

    @property
    def gateways(self) -> tuple[Gateway, Gateway]:
        return self.a, self.b

    def routed(self) -> dict[str, str]:
        """Replica id -> url of the ready replicas the routing tables hold."""
        return {v.replica_id: v.record.url for v in self.tables.snapshot(MODEL) if v.record.state == ReplicaState.READY}


@pytest.fixture
def topology(own_redis: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Topology]:
    """Gateways A (`indirect` parameter: its number of replicas, default 2) and B (none) on `own_redis`."""
    replicas = getattr(request, "param", 2)
    a = Gateway("a", package_copy(tmp_path / "pkg-a", replicas=replicas), tmp_path, own_redis.url)
    b = Gateway("b", package_copy(tmp_path / "pkg-b", replicas=0), tmp_path, own_redis.url)
    topo = Topology(a, b, own_redis.url)
    try:
        a.launch().wait_ready()
        b.launch().wait_ready()
        wait_until(lambda: len(topo.routed()) == replicas, 30, f"{replicas} replicas in the routing tables")
        assert b.replicas() == []  # B runs none: everything it serves goes to A's replicas through the tables
        yield topo
    finally:
        b.stop()
        a.stop()
        topo.tables.close()


def finished(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(sum(float(m.group(1)) for m in
                   re.finditer(r"^ember_requests_finished_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)))


def served_by(urls: dict[str, str]) -> dict[str, int]:
    return {rid: finished(url) for rid, url in urls.items()}


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def complete(gateway: Gateway, prompt: list[int] | str, *, model: str = MODEL, max_tokens: int = 4) -> Any:
    return gateway.client().completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)


def cached(reply: Any) -> int:
    details = reply.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


# --- kill -9 of a replica ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("topology", [3], indirect=True)
def test_a_killed_replica_is_no_longer_chosen_once_its_lease_lapses(topology: Topology) -> None:
    a, b = topology.gateways
    urls = topology.routed()
    long_prefix = tokens(250, seed=1)            # 15 full blocks of 16 tokens
    longer = long_prefix + tokens(125, seed=2)   # 23 full blocks

    # The prefix goes to one replica; KV-aware routing sends it (and prompts that extend it) back there from either
    # gateway: B finds it through the blocks the replica published to Redis.
    before = served_by(urls)
    complete(a, long_prefix)
    after = served_by(urls)
    holder = next(rid for rid in urls if after[rid] == before[rid] + 1)
    assert cached(complete(b, longer)) == 15 * 16
    assert cached(complete(a, longer)) == 23 * 16
    assert served_by(urls)[holder] == after[holder] + 2
    record = next(v.record for v in topology.tables.snapshot(MODEL) if v.replica_id == holder)
    blocks = topology.tables.blocks(holder)
    pid = next(r["pid"] for r in a.replicas() if r["id"] == holder)

    # kill -9: no drain, no goodbye to the tables. A thread watches the tables for the lease to lapse.
    lapsed: list[float] = []

    def watch() -> None:
        while time.monotonic() - killed_at < 30 and not lapsed:
            if holder not in {v.replica_id for v in topology.tables.snapshot(MODEL)}:
                lapsed.append(time.monotonic() - killed_at)
            time.sleep(0.02)

    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # Within the lease the tables still offer the dead replica, and it holds the prefix: requests for it may be sent
    # there first (by B until the lease lapses; by A until its control plane notices the exit). The connection is
    # refused before anything was sent, so the gateway sends the request to another replica: every one succeeds.
    for gateway in (b, a, b, a):
        assert complete(gateway, long_prefix).usage.completion_tokens == 4
    watcher.join(35)
    assert lapsed, f"replica {holder} still in the routing tables 30 s after kill -9"
    assert lapsed[0] <= TTL_S + 2.0, f"replica {holder} left the tables {lapsed[0]:.1f} s after kill -9"

    # The same moment made deterministic: the dead replica's record and blocks as its last heartbeat left them, with
    # a lease still running. B's router picks it (it alone holds all of `longer`), the connection is refused, and
    # B sends the request on: one retry, no error.
    topology.tables.heartbeat(record, incarnation="dead-replica-last-beat", epoch=None, ttl_s=60)
    topology.tables.replace_blocks(holder, blocks, ttl_s=60)
    retries = b.retries()
    reply = complete(b, longer)
    assert reply.usage.completion_tokens == 4
    assert b.retries() == retries + 1, b.log_tail()
    topology.tables.remove_replica(MODEL, holder)

    # After the lease: requests through both gateways all succeed, and none is sent to the dead replica (a gateway
    # counts every request it had to send elsewhere); the survivors (and A's replacement) serve them all.
    assert holder not in topology.routed()
    wait_until(lambda: holder not in {r["id"] for r in a.replicas()}, 10, "A's control plane to bury the replica")
    # A's control plane replaces the dead replica (desired: 3); wait for the replacement, so that the count of what the
    # replicas served below covers every one of them.
    wait_until(lambda: len(topology.routed()) == 3, 60, "A's replacement replica in the tables")
    live = topology.routed()
    assert holder not in live
    retries_before = {g.name: g.retries() for g in (a, b)}
    served_before = served_by(live)
    prompts = [long_prefix, longer, tokens(64, seed=3), "def fibonacci(n):"]
    for i in range(8):
        gateway = (a, b)[i % 2]
        assert complete(gateway, prompts[i % len(prompts)]).usage.completion_tokens == 4
    assert {g.name: g.retries() for g in (a, b)} == retries_before
    served_after = served_by(live)
    assert sum(served_after.values()) - sum(served_before.values()) == 8


# --- a Redis restart ----------------------------------------------------------------------------------------------


def test_gateways_and_replicas_reconnect_after_a_redis_restart(topology: Topology, own_redis: Any) -> None:
    a, b = topology.gateways
    urls = topology.routed()
    prefix = tokens(250, seed=11)  # 15 full blocks
    complete(a, prefix)
    assert cached(complete(b, prefix)) == 15 * 16  # B routed it to the replica holding it: the tables work
    blocks_before = {rid: len(topology.tables.blocks(rid)) for rid in urls}
    holder = max(blocks_before, key=blocks_before.__getitem__)
    assert blocks_before[holder] >= 15
    infos = {g.name: g.info() for g in (a, b)}
    states = {name: (info["state"], info["state_source"]) for name, info in infos.items()}
    assert states == {"a": ("warm", "routing tables"), "b": ("warm", "routing tables")}  # A wrote it; B reads it
    assert topology.tables.stored_deployment_state(MODEL) == "warm"

    own_redis.kill()  # everything in it is lost: no persistence
    # While it is down, requests either succeed (A routes to its own replicas on load alone; B, which knows of no
    # replica without the tables, cold-starts one of its own) or are refused with 503 and Retry-After: never a 500,
    # never a hang.
    outage: list[str] = []
    for i, gateway in enumerate((a, b, a, b)):
        try:
            reply = gateway.client(timeout=120).completions.create(model=MODEL, prompt=f"def outage_{i}(x):",
                                                                   max_tokens=2, temperature=0)
            assert reply.usage.completion_tokens == 2
            outage.append("ok")
        except openai.APIStatusError as e:
            assert e.status_code == 503 and e.response.headers.get("retry-after"), (e.status_code, e.message)
            outage.append("503")
    assert outage[0] == "ok" and outage[2] == "ok"  # A serves with its own replicas
    assert a.info()["state_source"].startswith("this gateway's replicas")  # /info still answers

    own_redis.start()  # the same port, empty
    # Nobody restarted: the replicas' next heartbeats register them again and resend their whole block sets; A
    # writes the deployment state again; both gateways' clients reconnect by themselves.
    wait_until(lambda: set(urls) <= set(topology.routed()), 15, "A's replicas back in the tables")
    wait_until(lambda: len(topology.tables.blocks(holder)) >= blocks_before[holder], 15, "the block sets resent")
    wait_until(lambda: topology.tables.stored_deployment_state(MODEL) == "warm", 15, "A to write the state again")
    for gateway in (a, b):
        assert gateway.info()["state_source"] == "routing tables"
    # Prefix routing works again through either gateway, from the rebuilt tables.
    assert cached(complete(b, prefix)) == 15 * 16
    assert cached(complete(a, prefix)) == 15 * 16
    for i in range(6):
        assert complete((a, b)[i % 2], f"def after_{i}(x):").usage.completion_tokens == 4
