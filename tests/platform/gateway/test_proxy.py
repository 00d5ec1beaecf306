"""The proxy's connections to replicas, against real sockets on loopback: a pooled connection that the replica closes
as a request goes out costs a retry on a fresh connection, not a 503."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ember.manifest import parse_manifest
from ember_platform.control.deployments import Replica, ReplicaState
from ember_platform.control.plane import NoReplicaAvailable
from ember_platform.gateway.metrics import GatewayMetrics
from ember_platform.gateway.proxy import POOL_KEEPALIVE_S, Proxy
from ember_platform.replica.server import KEEPALIVE_SECONDS

BODY = b'{"object":"text_completion"}'


class StaleKeepAliveServer:
    """HTTP/1.1 on loopback whose first connection answers one request, keeps the connection open, then closes it
    without a word when the next request arrives on it: what a replica whose keep-alive timeout runs out (or that
    is stopping) does to a pooled connection just as the gateway sends on it. Later connections answer everything.
    """

    def __init__(self, *, stale_connections: int = 1) -> None:
        self.stale_connections = stale_connections
        self.connections = 0
        self.requests = 0
        self.answered = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        stale = self.connections <= self.stale_connections
        served_here = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.requests += 1
                if stale and served_here == 1:
                    return  # closes the connection: the request is never answered
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))
                await writer.drain()
                served_here += 1
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


class OneReplicaPlane:
    """The part of the control plane the proxy uses, over one ready replica at `url`."""

    def __init__(self, url: str) -> None:
        self.replica = Replica(version="1", state=ReplicaState.READY, local_url=url)
        # A version without a hooks.py: its request hooks (the installed plugins') leave the body as it is.
        version = SimpleNamespace(version="1", package_dir=Path(__file__).parent, digest=None,
                                  manifest=parse_manifest({"model": {"name": "m", "version": "1"}}))
        self.deployment = SimpleNamespace(name="m", request_timeout=10.0, ready_replicas=lambda: [self.replica],
                                          active_version="1", active=version, versions={"1": version})
        self.unreachable: list[str] = []

    async def acquire(self, name: str) -> list[Replica]:
        return [self.replica]

    def get(self, name: str) -> Any:
        return self.deployment

    def report_unreachable(self, dep: Any, replica: Replica) -> None:
        self.unreachable.append(replica.id)

    def report_unavailable(self, dep: Any, replica: Replica) -> None:
        raise AssertionError("the fake replica never answers 503")


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _forward(proxy: Proxy) -> bytes:
    """One request through the proxy, relayed as the gateway's ASGI response; returns the body the client got."""
    response = await proxy.forward("m", "/v1/completions", b"{}", request_id="r", endpoint="completions",
                                   received_at=0.0, receive=_never_disconnects)
    assert response is not None
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await response({"type": "http"}, _never_disconnects, send)
    assert sent[0]["status"] == 200
    return b"".join(m.get("body", b"") for m in sent[1:])


async def _run(server: StaleKeepAliveServer, requests: int) -> tuple[list[bytes | Exception], OneReplicaPlane]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    plane = OneReplicaPlane(f"http://127.0.0.1:{port}")
    proxy = Proxy(plane, GatewayMetrics())  # type: ignore[arg-type]  # the plane's surface the proxy uses
    results: list[bytes | Exception] = []
    try:
        for _ in range(requests):  # one after the other: the second reuses the first one's pooled connection
            try:
                results.append(await _forward(proxy))
            except NoReplicaAvailable as e:
                results.append(e)
    finally:
        await proxy.aclose()
        listener.close()
        await listener.wait_closed()
    return results, plane


def test_a_pooled_connection_closed_as_the_request_goes_out_is_retried_on_a_fresh_one() -> None:
    server = StaleKeepAliveServer()
    results, plane = asyncio.run(_run(server, requests=3))
    assert results == [BODY, BODY, BODY]
    # The second request met the stale connection, then went out again on a new one, which the third reused.
    assert (server.connections, server.requests, server.answered) == (2, 4, 3)
    assert plane.unreachable == []  # a stale connection says nothing about the replica


def test_the_retry_is_one_only() -> None:
    # Two pooled connections, both of which the replica closes on their next request: the retry meets the second
    # one, and the request is then treated as a replica that cannot be reached (another would be tried; here there
    # is none).
    server = StaleKeepAliveServer(stale_connections=10**6)

    async def main() -> tuple[list[bytes], Exception | None, OneReplicaPlane]:
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        plane = OneReplicaPlane(f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}")
        proxy = Proxy(plane, GatewayMetrics())  # type: ignore[arg-type]
        try:
            first = await asyncio.gather(_forward(proxy), _forward(proxy))  # two connections at once, both pooled
            try:
                await _forward(proxy)
            except NoReplicaAvailable as e:
                return list(first), e, plane
            return list(first), None, plane
        finally:
            await proxy.aclose()
            listener.close()
            await listener.wait_closed()

    first, error, plane = asyncio.run(main())
    assert first == [BODY, BODY] and isinstance(error, NoReplicaAvailable)
    assert (server.connections, server.requests) == (2, 4) and plane.unreachable == [plane.replica.id]


def test_the_gateway_drops_idle_connections_before_a_replica_would() -> None:
    # Otherwise the replica's keep-alive timeout can close a connection just as the gateway sends on it.
    assert POOL_KEEPALIVE_S < KEEPALIVE_SECONDS


@pytest.fixture(autouse=True)
def _quiet_proxy_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="ember.gateway")
