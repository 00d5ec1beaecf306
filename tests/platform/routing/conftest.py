"""A real `redis-server` for the routing tests, and a fixture that runs a test on both table backends."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ember.plugins import PluginHost
from ember_platform.routing import RoutingTables
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
            pytest.skip("redis-server is not installed (apt-get install -y redis-server; scripts/setup-env "
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
