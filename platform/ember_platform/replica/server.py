"""The replica process: uvicorn serving the app at once (liveness), the model loading behind it, a drain on SIGTERM.

Signals are the replica's own, not uvicorn's: the first SIGTERM or SIGINT starts a drain (new generation requests
get 503 + Retry-After, requests in flight finish, bounded by the drain timeout), then the server stops and the
process exits 0. A second signal stops it at once. A replica whose engine died drains the same way and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, TypeVar

import uvicorn

from ember.launch import READY_LINE
from ember_platform.gateway.connections import ConnectionLimits, guarded_protocol
from ember_platform.replica.app import create_app
from ember_platform.replica.core import STARTING, Replica
from ember_platform.replica.routing import RoutingPresence

log = logging.getLogger("ember.replica")

# READY_LINE (ember.launch) is printed with the URL once /ready answers 200; process launchers wait for it
LISTENING_LINE = "EMBER_REPLICA_LISTENING"  # printed with the URL once /health answers (the model still loads)
DEFAULT_DRAIN_TIMEOUT = 30.0
# After the drain, connections still open (idle keep-alives, or requests past the drain timeout) get this long.
SHUTDOWN_GRACE_SECONDS = 2.0
ENGINE_WATCH_INTERVAL = 0.2  # seconds between two looks at whether the engine's step loop died
# How long an idle keep-alive connection stays open: longer than the gateway keeps one in its pool
# (gateway/proxy.py POOL_KEEPALIVE_S), so that it is the gateway that drops it, never a replica as a request arrives.
KEEPALIVE_SECONDS = 75.0
# asyncio's event loop, not uvloop, even where uvloop is installed (the gateway uses it): the engine's step thread
# shares this process's GIL with the loop, and uvloop makes its socket writes holding the GIL (asyncio releases it
# around each send) and takes the GIL back for every libuv callback. With uvloop here the step thread was off its
# core ~0.05 s more per bench_gateway.py run (32 streams, ~3.5 s) and throughput was ~3% lower, though the loop itself
# spent less CPU. The HTTP parser is httptools when installed (C, no I/O of its own), else h11. No access log below
# debug either: the gateway logs every request, and here each line cost the loop ~1-2 ms (formatting and a write).
EVENT_LOOP = "asyncio"

T = TypeVar("T")


async def _in_daemon_thread(fn: Callable[[], T]) -> T:
    """Run a blocking call in a daemon thread, so a process told to stop while loading does not wait for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # a closed loop: the server stopped while this ran
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="ember-replica-load", daemon=True).start()
    return await future


class ReplicaServer(uvicorn.Server):
    """uvicorn's server with the replica's lifecycle: load after binding, announce readiness, drain on signals."""

    def __init__(self, config: uvicorn.Config, replica: Replica, *,
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT, redis_url: str | None = None) -> None:
        super().__init__(config)
        self.replica = replica
        self.redis_url = redis_url
        self.presence: RoutingPresence | None = None  # in the shared routing tables, once loaded
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        self._loop = asyncio.get_running_loop()
        self.url = self._bound_url()
        print(f"{LISTENING_LINE} {self.url}", flush=True)
        self._spawn(self._load())

    def _bound_url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]  # the real port when --port 0
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self) -> None:
        try:
            await _in_daemon_thread(self.replica.load)
        except Exception:
            log.exception("the replica failed to load %s", self.replica.package_dir)
            self.exit_code = 1
            self.should_exit = True
            return
        if self.redis_url and not self._draining:
            assert self.replica.engine is not None
            manifest = self.replica.manifest
            try:
                self.presence = RoutingPresence(self.redis_url, self.replica.engine, url=self.url,
                                                model=manifest.model.name, version=manifest.model.version).start()
            except Exception:  # a replica that cannot publish still serves what reaches it directly
                log.exception("cannot publish to the routing tables at %s", self.redis_url)
        if not self._draining:
            print(f"{READY_LINE} {self.url}", flush=True)
            self._spawn(self._exit_when_engine_dies())

    async def _exit_when_engine_dies(self) -> None:
        """A replica whose engine died can serve nothing again: drain what is still in flight (those requests fail
        on their own) and exit 1, so that no launcher, or no launcher at all, leaves it holding its memory."""
        while self.replica.failure is None:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL)
        log.error("%s; exiting once no request is in flight", self.replica.failure)
        self.exit_code = 1
        if not self._draining:
            self._draining = True
            await self._drain()

    # --- signals and the drain ----------------------------------------------------------------

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler, replaced: a drain first, a second signal stops at once.

        It never re-raises the signal afterwards (as uvicorn does), so a drained replica exits 0.
        """
        if self._draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        log.info("%s: draining (up to %.0f s for %d request(s) in flight)", signal.Signals(sig).name,
                 self.drain_timeout, self.replica.num_in_flight)
        self._loop.call_soon_threadsafe(self._spawn, self._drain())

    def drain(self) -> None:
        """Start a drain from code (tests, an embedding launcher), as SIGTERM would."""
        self.handle_exit(signal.SIGTERM, None)

    async def _drain(self) -> None:
        was_starting = self.replica.state == STARTING
        self.replica.begin_drain()
        if self.presence is not None:
            self.presence.draining()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while self.replica.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.replica.num_in_flight:
            log.warning("drain timeout (%.0f s) reached with %d request(s) still in flight: they are cut off",
                        self.drain_timeout, self.replica.num_in_flight)
        elif not was_starting:
            log.info("drained: no requests in flight")
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        for task in list(self._tasks):
            task.cancel()
        if self.presence is not None:
            self.presence.close()
        self.replica.close()


def serve(replica: Replica, *, host: str = "127.0.0.1", port: int = 0, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
          log_level: str = "info", redis_url: str | None = None, secret: str | None = None) -> int:
    """Serve a replica until drained; returns the process exit code (0 after a drain, 1 if loading failed or the
    engine died). `secret`: what every request but the probes must carry (replica/auth.py); None serves everyone."""
    app = create_app(replica, secret=secret)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS, timeout_keep_alive=KEEPALIVE_SECONDS,
                            loop=EVENT_LOOP, http=guarded_protocol(ConnectionLimits.from_env(replica=True)),
                            access_log=log_level in ("debug", "trace"))
    server = ReplicaServer(config, replica, drain_timeout=drain_timeout, redis_url=redis_url)
    server.run()
    return server.exit_code
