"""Fixtures of the gateway tests: raw sockets, for what an HTTP client library would not send."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest


def closed_after(sock: socket.socket, limit: float = 5.0) -> tuple[float, bytes]:
    """Seconds until the server closed the connection (reading whatever it sent first), or fails after `limit`."""
    start, received = time.monotonic(), b""
    sock.settimeout(limit)
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        raise AssertionError(f"the connection was still open after {limit} s") from None
    except ConnectionResetError:
        pass
    return time.monotonic() - start, received


@pytest.fixture(name="closed_after", scope="session")
def closed_after_fixture() -> Callable[..., tuple[float, bytes]]:
    """closed_after(sock, limit=5.0): see `closed_after`."""
    return closed_after
