"""gateway/connections.py on both of uvicorn's HTTP parsers (httptools and h11): a real uvicorn on loopback in a
thread, raw sockets as the slow clients, a Starlette app that reads the whole body."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ember_platform.gateway.connections import ConnectionLimits, guarded_protocol

LIMITS = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_per_client=3)


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"bytes": len(await request.body())})


@pytest.fixture(params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=guarded_protocol(LIMITS, request.param), lifespan="off", log_level="warning",
                            loop="asyncio")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield sock.getsockname()
    server.should_exit = True
    thread.join(10)
    sock.close()


def _connect(address: tuple[str, int]) -> socket.socket:
    return socket.create_connection(address, timeout=5)


def _response(sock: socket.socket) -> bytes:
    """One whole response (status line, headers and its content-length of body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return data


def _post(body: bytes) -> bytes:
    return (b"POST /echo HTTP/1.1\r\nHost: t\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def test_partial_headers_are_closed_after_the_header_timeout(server: tuple[str, int], closed_after) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\n")
        waited, received = closed_after(sock)
    assert 0.4 <= waited < 3 and received == b""


def test_a_stalled_body_is_answered_408_and_closed(server: tuple[str, int], closed_after) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\ncontent-length: 100\r\n\r\nabc")
        waited, received = closed_after(sock)
    assert 0.4 <= waited < 3
    assert received.startswith(b"HTTP/1.1 408") and b"connection: close" in received.lower()


def test_a_kept_alive_connection_gets_a_fresh_header_clock_per_request(server: tuple[str, int], closed_after) -> None:
    with _connect(server) as sock:
        for _ in range(3):  # idle longer than the header timeout between requests: uvicorn's keep-alive governs
            sock.sendall(_post(b"hello"))
            assert _response(sock).startswith(b"HTTP/1.1 200")
            time.sleep(0.7)
        sock.sendall(b"POST /echo HTTP/1.1\r\n")  # then a request that never finishes its headers
        waited, _ = closed_after(sock)
    assert waited < 3


def test_connections_over_the_per_client_cap_get_429_and_the_count_is_released(server: tuple[str, int],
                                                                               closed_after) -> None:
    held = [_connect(server) for _ in range(3)]
    time.sleep(0.1)
    with _connect(server) as extra:
        extra.sendall(_post(b"hello"))
        _, received = closed_after(extra)
    assert received.startswith(b"HTTP/1.1 429") and b"too_many_connections" in received
    # A real client sees the 429 as an answer to its request (it was once written before the request was read,
    # which clients saw as a reset connection: a lost request).
    host, port = server
    refused = httpx.post(f"http://{host}:{port}/echo", content=b"hi", timeout=5)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "too_many_connections"
    with _connect(server) as silent:  # one that never sends its headers is closed at the header timeout
        waited, nothing = closed_after(silent)
    assert waited < 3 and nothing == b""
    for sock in held:
        sock.close()
    time.sleep(0.1)
    with _connect(server) as sock:
        sock.sendall(_post(b"x" * 10))
        assert _response(sock).startswith(b"HTTP/1.1 200")


def test_a_request_uvicorn_cannot_parse_gets_an_openai_error_object(server: tuple[str, int], closed_after) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n")
        _, received = closed_after(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "invalid_http_request"
