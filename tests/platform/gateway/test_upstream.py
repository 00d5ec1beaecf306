"""The gateway's upstream transport: httpcore's pool decisions, made in linear time, over real connections too."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time

import httpcore
import httpx
import pytest

from ember_platform.gateway.upstream import LinearConnectionPool, upstream_transport

STOCK_ASSIGN = httpcore.AsyncConnectionPool._assign_requests_to_connections


class FakeConnection:
    """What the pool asks of a connection, fixed: closed, expired, idle, available, and the origin it serves."""

    def __init__(self, name: str, origin: str, *, closed: bool, expired: bool, idle: bool, available: bool) -> None:
        self.name, self.origin = name, origin
        self.closed, self.expired, self.idle, self.available = closed, expired, idle, available

    def is_closed(self) -> bool:
        return self.closed

    def has_expired(self) -> bool:
        return self.expired

    def is_idle(self) -> bool:
        return self.idle

    def is_available(self) -> bool:
        return self.available

    def can_handle_request(self, origin: str) -> bool:
        return origin == self.origin

    def __repr__(self) -> str:
        return self.name


class FakeURL:
    def __init__(self, origin: str) -> None:
        self.origin = origin


class FakeRequest:
    def __init__(self, origin: str) -> None:
        self.url = FakeURL(origin)


class FakePoolRequest:
    def __init__(self, name: str, origin: str, connection: FakeConnection | None) -> None:
        self.name = name
        self.request = FakeRequest(origin)
        self.connection = connection

    def is_queued(self) -> bool:
        return self.connection is None

    def assign_to_connection(self, connection: FakeConnection) -> None:
        self.connection = connection


def _pool_state(rng: random.Random) -> dict:
    origins = ["a", "b", "c"]
    connections = []
    for i in range(rng.randint(0, 12)):
        idle = rng.random() < 0.5
        connections.append(dict(name=f"c{i}", origin=rng.choice(origins), closed=rng.random() < 0.15,
                                expired=rng.random() < 0.15, idle=idle,
                                # an HTTP/2 connection can take more requests while busy: available, not idle
                                available=rng.random() < (0.8 if idle else 0.2)))
    requests = [dict(name=f"r{i}", origin=rng.choice(origins), assigned=rng.random() < 0.4)
                for i in range(rng.randint(0, 6))]
    return {"connections": connections, "requests": requests, "max_connections": rng.choice([2, 4, 8, 100]),
            "max_keepalive": rng.choice([0, 1, 3, 64])}


def _run(assign, state: dict) -> tuple[list[str], list[str], list[tuple[str, str | None]]]:
    """Apply one assignment method to a pool in `state`; return (connections, closing, request -> connection)."""
    pool = httpcore.AsyncConnectionPool(max_connections=state["max_connections"],
                                        max_keepalive_connections=state["max_keepalive"])
    pool._connections = [FakeConnection(**c) for c in state["connections"]]
    live = [c for c in pool._connections if not c.closed]
    pool._requests = [FakePoolRequest(r["name"], r["origin"], live[0] if r["assigned"] and live else None)
                      for r in state["requests"]]
    made = iter(range(1000))
    pool.create_connection = lambda origin: FakeConnection(f"new{next(made)}", origin, closed=False, expired=False,
                                                           idle=False, available=False)
    closing = assign(pool)
    return ([c.name for c in pool._connections], [c.name for c in closing],
            [(r.name, r.connection and r.connection.name) for r in pool._requests])


def test_linear_pool_decides_exactly_as_httpcores_pool():
    rng = random.Random(4)
    for _ in range(3000):
        state = _pool_state(rng)
        assert _run(LinearConnectionPool._assign_requests_to_connections, state) == _run(STOCK_ASSIGN, state), state


def test_transport_uses_the_linear_pool_with_the_limits():
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=7, keepalive_expiry=12.0)
    transport = upstream_transport(limits)
    pool = transport._pool
    assert type(pool) is LinearConnectionPool
    assert (pool._max_keepalive_connections, pool._keepalive_expiry) == (7, 12.0)


@pytest.fixture
def chunked_server():
    """A tiny HTTP/1.1 keep-alive server on loopback: each request gets a chunked answer of 3 chunks."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    stop = threading.Event()
    accepted: list[int] = []

    def handle(conn: socket.socket) -> None:
        with conn:
            buffer = b""
            while not stop.is_set():
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                _, buffer = buffer.split(b"\r\n\r\n", 1)
                time.sleep(0.02)  # keep the stream open a little, as a generating replica does
                body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (b"data: 1\n\n", b"data: 2\n\n",
                                                                                   b"data: [DONE]\n\n"))
                conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"
                             + body + b"0\r\n\r\n")

    def serve() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", accepted
    stop.set()
    thread.join(5)
    sock.close()


def test_concurrent_streams_over_the_linear_pool(chunked_server):
    url, accepted = chunked_server
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=4, keepalive_expiry=30.0)

    async def main() -> list[bytes]:
        async with httpx.AsyncClient(transport=upstream_transport(limits), limits=limits) as client:
            async def one() -> bytes:
                async with client.stream("POST", f"{url}/v1/completions", content=b"{}") as response:
                    return b"".join([chunk async for chunk in response.aiter_raw()])

            first = await asyncio.gather(*(one() for _ in range(16)))
            pool = client._transport._pool
            assert len(pool.connections) == 4  # the surplus idle connections were closed, 4 kept alive
            again = await asyncio.gather(*(one() for _ in range(4)))  # these reuse the 4 kept
            return [*first, *again]

    bodies = asyncio.run(main())
    assert bodies == [b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"] * 20
    assert len(accepted) == 16
