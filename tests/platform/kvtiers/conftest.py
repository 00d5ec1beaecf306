"""Fixtures for the KV tier tests: a real S3 endpoint (a moto server in its own process, on loopback), endpoints
that are dead or never answer, and the example model's engine settings.

The moto server comes from tests/conftest.py (`start_moto`), as for tests/ember.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def dummy_aws(aws_sandbox: None) -> None:
    """Nothing here can reach a real AWS account or read ~/.aws."""


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory, start_moto: Callable[..., Any]) -> Iterator[Any]:
    """One S3 endpoint for the session; each test takes a fresh bucket (`moto.new_bucket()`)."""
    server = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def own_moto(tmp_path: Path, start_moto: Callable[..., Any]) -> Iterator[Any]:
    """An S3 endpoint of this test's own, which it may stop."""
    server = start_moto(tmp_path / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An endpoint that accepts connections and never answers: every request runs into its read timeout."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                held.append(conn)  # read nothing, answer nothing
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()
