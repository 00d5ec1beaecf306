"""A real `redis-server` for the routing tests, a fixture that runs a test on both table backends, and the
processes of the end-to-end tests: gateways (`ember serve --redis-url`) with the replicas they run.

pytest's importlib mode lets no test module import another, nor a conftest: the end-to-end modules reach the shared
helpers through fixtures (`start_topology`, `wait_until`), as tests/conftest.py hands out `start_moto`."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ember.plugins import PluginHost
from ember_platform.routing import ReplicaState, RoutingTables
from ember_platform.routing.memory import InProcessTables
from ember_platform.routing.redis_tables import RedisTables

REDIS_SERVER = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists()
                                                else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process without persistence: a restart loses everything, as in the tests' scenario."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server; scripts/setup-env --for-tests "
                        "installs it when run as root)")
        self.workdir = workdir
        self.port = port or _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.process.returncode}: "
                                   f"{err or (log.read_text() if log.exists() else '')}")
            if self.ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, like a crash: nothing is saved (nothing would be anyway)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the session; tests keep apart by namespace. Tests that restart Redis use `own_redis`."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own, which it may kill and start again on the same port."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def namespace() -> str:
    return f"test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture(params=["memory", "redis"])
def make_tables(request: pytest.FixtureRequest, namespace: str) -> Iterator[Callable[[], RoutingTables]]:
    """make_tables() -> a view of one shared set of tables: for Redis a new client each call (another gateway or
    replica), in process the same object (they share memory)."""
    opened: list[RoutingTables] = []
    if request.param == "memory":
        shared = InProcessTables()

        def make() -> RoutingTables:
            return shared
    else:
        server: RedisServer = request.getfixturevalue("redis_server")

        def make() -> RoutingTables:
            tables = RedisTables.from_url(server.url, namespace=namespace)
            opened.append(tables)
            return tables
    yield make
    for tables in opened:
        tables.close()


@pytest.fixture
def scorer_host() -> PluginHost:
    """A plugin host with just the built-in routing plugin, registered as its entry point would register it."""
    import ember_plugins.routing

    host = PluginHost(entry_points=False, disabled=())
    host.register(ember_plugins.routing, "routing")
    return host


# --- end to end: gateways (`ember serve --redis-url`) and their replicas, in processes of their own ---------------

REPO = Path(__file__).resolve().parents[3]
MODEL = "tiny-llama"
READY_TIMEOUT_S = 180.0
CLUSTER_SECRET = "cluster-secret-for-tests"  # what every gateway of a topology shares for its replicas


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

    def __init__(self, name: str, package: Path, workdir: Path, redis_url: str,
                 stop_serve: Callable[..., None]) -> None:
        self.name = name
        self._stop_serve = stop_serve  # tests/conftest.py's, through its fixture
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
               "EMBER_ROUTING": "kv", "EMBER_REPLICA_SECRET": CLUSTER_SECRET}  # B calls A's replicas with it
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
        self._stop_serve(self.process, self.pids, self.home)


class Topology:
    """The topology of bench/bench_routing.py: gateway A runs the replicas, which publish to Redis; gateway B runs
    none and routes to A's replicas through the shared tables alone."""

    def __init__(self, a: Gateway, b: Gateway, redis_url: str) -> None:
        self.a, self.b = a, b
        self.tables = RedisTables.from_url(redis_url)  # what every gateway and replica shares
        self.replica_headers = {"Authorization": f"Bearer {CLUSTER_SECRET}"}  # to call a replica directly

    @property
    def gateways(self) -> tuple[Gateway, Gateway]:
        return self.a, self.b

    def routed(self) -> dict[str, str]:
        """Replica id -> url of the ready replicas the routing tables hold."""
        return {v.replica_id: v.record.url for v in self.tables.snapshot(MODEL) if v.record.state == ReplicaState.READY}

    @staticmethod
    def served_by(urls: dict[str, str]) -> dict[str, int]:
        """Replica id -> requests the replica at its url has served (its own count)."""
        return {rid: finished(url) for rid, url in urls.items()}

    def close(self) -> None:
        self.b.stop()
        self.a.stop()
        self.tables.close()


def finished(url: str) -> int:
    """Requests the replica at `url` has served (its own count)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(sum(float(m.group(1)) for m in
                   re.finditer(r"^ember_requests_finished_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)))


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    """wait_until(predicate, timeout, what, interval=0.05) -> the predicate's first true value; AssertionError naming
    `what` once `timeout` s have passed."""
    return wait_until


@pytest.fixture
def start_topology(own_redis: RedisServer, tmp_path: Path, stop_serve: Callable[..., None],
                   example_copy: Callable[..., Path]) -> Iterator[Callable[..., Topology]]:
    """start_topology(replicas, adapters=None, manifest_extra="") -> a `Topology` on `own_redis`, each gateway with its
    own copy of the package (`package_copy`): A with `replicas` replicas, B with none. Returns once both gateways are
    ready and A's replicas are in the routing tables; stops both, and kills their replicas, after the test."""
    started: list[Topology] = []

    def package_copy(dest: Path, replicas: int, **package_options: Any) -> Path:
        """The example with `replicas` replicas at deploy time (0: scaled to zero) and no autoscaling, without its lock
        (`package_options`: `adapters`, `manifest_extra`, see `example_copy`)."""
        return example_copy(dest, lock=False, min_replicas=replicas, max_replicas=max(1, replicas),
                            prewarm=bool(replicas), target_concurrency=1000, **package_options)

    def start(replicas: int, **package_options: Any) -> Topology:
        a = Gateway("a", package_copy(tmp_path / "pkg-a", replicas, **package_options), tmp_path,
                    own_redis.url, stop_serve)
        b = Gateway("b", package_copy(tmp_path / "pkg-b", 0, **package_options), tmp_path, own_redis.url,
                    stop_serve)
        topo = Topology(a, b, own_redis.url)
        started.append(topo)
        a.launch().wait_ready()
        b.launch().wait_ready()
        wait_until(lambda: len(topo.routed()) == replicas, 30, f"{replicas} replicas in the routing tables")
        assert b.replicas() == []  # B runs none: everything it serves goes to A's replicas through the tables
        return topo

    yield start
    for topo in started:
        topo.close()
