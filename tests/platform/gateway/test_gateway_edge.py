"""The gateway's edge against hostile clients, through a real `ember serve` (and its real replica) on loopback:
hostile JSON is a 4xx OpenAI error object that keeps the connection, slow clients are cut off by read timeouts,
one address cannot hold every connection, and a huge prompt does not stall the event loop."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-llama"
MODEL = "tiny-llama"
REPLICA_SECRET = "edge-tests-replica-secret"
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
PER_CLIENT = 16
PROBE_INTERVAL_S = 0.01
# Python exception names that a response body must never show.
EXCEPTION_NAMES = ("RecursionError", "UnicodeEncodeError", "UnicodeDecodeError", "TypeError", "ValueError",
                   "KeyError", "Traceback", "Exception")


@dataclass
class Served:
    url: str
    process: subprocess.Popen[str]
    home: Path
    pids: set[int] = field(default_factory=set)

    @property
    def address(self) -> tuple[str, int]:
        return _address(self.url)

    def replica_url(self) -> str:
        dep = httpx.get(f"{self.url}/admin/deployments/{MODEL}", timeout=30).json()
        self.pids.update(r["pid"] for r in dep["replicas"] if r["pid"])
        return next(r["url"] for r in dep["replicas"] if r["state"] == "ready")


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80




@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, stop_serve: Callable[..., None],
           serve_ready_url: Callable[..., str]) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("edge")
    env = {**os.environ, "EMBER_HOME": str(tmp / "home"), "EMBER_REGISTRY": str(tmp / "registry"),
           "EMBER_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "EMBER_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S), "EMBER_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
           "EMBER_MAX_CONNECTIONS_PER_CLIENT": str(PER_CLIENT), "EMBER_REPLICA_SECRET": REPLICA_SECRET}
    log = tmp / "serve.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(EXAMPLE), "--no-auth", "--port", "0"],
                                   env=env, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO)
    server = Served("", process, tmp / "home")
    try:
        server.url = serve_ready_url(process, log)
        server.replica_url()
        yield server
    finally:
        stop_serve(process, server.pids, server.home)


def _assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> None:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert not any(name in response.text for name in EXCEPTION_NAMES), response.text[:500]


DEEP = b'{"model": "tiny-llama", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
HOSTILE = {
    # case: (path, body, status, param, code)
    "10,000-deep nesting": ("/v1/completions", DEEP, 400, None, "invalid_json"),
    "lone surrogate in model": ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', 400, "model",
                                "invalid_unicode"),
    "lone surrogate in the prompt": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "def f():\\udfff"}',
                                     400, "prompt", "invalid_unicode"),
    "lone surrogate in a message": ("/v1/chat/completions",
                                    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "a\\udc00"}]}',
                                    400, "messages[0].content", "invalid_unicode"),
    "lone surrogate in stop": ("/v1/completions",
                               b'{"model": "tiny-llama", "prompt": "x", "stop": ["ok", "\\ud83d"]}', 400, "stop[1]",
                               "invalid_unicode"),
    "lone surrogate as raw bytes in model": ("/v1/chat/completions",
                                             b'{"model": "\xed\xa0\x80", "messages": [{"role": "user", "content": '
                                             b'"x"}]}', 400, "model", "invalid_unicode"),
    "2,500 prompts": ("/v1/completions", json.dumps({"model": MODEL, "prompt": ["x"] * 2500}).encode(), 400,
                      "prompt", None),
    "a 50 MB body": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "' + b"a" * (50 << 20) + b'"}', 413,
                     None, "request_too_large"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_json_is_a_4xx_openai_error_and_the_connection_survives(served: Served, case: str) -> None:
    path, body, status, param, code = HOSTILE[case]
    with httpx.Client(base_url=served.url, timeout=60) as client:
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        _assert_openai_error(response, status, param, code)
        if case == "10,000-deep nesting":
            assert "64" in response.json()["error"]["message"]
        stream = response.extensions["network_stream"]
        after = client.post("/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 2})
        assert after.status_code == 200, after.text
        assert after.extensions["network_stream"] is stream, "the 4xx closed the keep-alive connection"


@pytest.mark.parametrize("case", ["10,000-deep nesting", "lone surrogate in the prompt", "lone surrogate in a message",
                                  "2,500 prompts"])
def test_a_replica_called_directly_answers_hostile_json_with_a_4xx_too(served: Served, case: str) -> None:
    path, body, status, param, code = HOSTILE[case]
    response = httpx.post(served.replica_url() + path, content=body, timeout=60,
                          headers={"content-type": "application/json", "authorization": f"Bearer {REPLICA_SECRET}"})
    _assert_openai_error(response, status, param, code)


# --- read timeouts and the per-client cap, with raw sockets ------------------------------------------------


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.settimeout(10)
    return sock


@pytest.mark.parametrize("target", ["gateway", "replica"])
def test_partial_headers_are_closed_after_the_header_timeout(served: Served, target: str, closed_after) -> None:
    address = served.address if target == "gateway" else _address(served.replica_url())
    with _connect(address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: edge\r\ncontent-type: application/json\r\n")
        waited, _ = closed_after(sock, HEADER_TIMEOUT_S + 4)
    assert waited >= HEADER_TIMEOUT_S * 0.8, waited
    with _connect(address) as idle:  # a connection that sends nothing at all is closed too
        closed_after(idle, HEADER_TIMEOUT_S + 4)


def test_headers_sent_a_byte_at_a_time_do_not_extend_the_timeout(served: Served, closed_after) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: edge\r\nX-Padding: " + b"a" * 200
    with _connect(served.address) as sock:
        start = time.monotonic()
        try:
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        closed_after(sock, HEADER_TIMEOUT_S + 4)
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 4


def test_a_partial_body_is_answered_408_and_closed(served: Served, closed_after) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: edge\r\ncontent-type: application/json\r\n"
            b"content-length: 200\r\n\r\n")
    with _connect(served.address) as sock:
        sock.sendall(head + b'{"model": "tiny-llama", "prompt": "')
        waited, received = closed_after(sock, BODY_TIMEOUT_S + 4)
    assert waited >= BODY_TIMEOUT_S * 0.8
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), received[:300]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert set(error) == {"message", "type", "param", "code"} and "body" in error["message"]


def test_connections_beyond_the_per_client_cap_are_refused(served: Served, closed_after) -> None:
    held = [_connect(served.address) for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.2)  # every one of them accepted by the server
        with _connect(served.address) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: edge\r\n\r\n")
            _, received = closed_after(extra, 5)
        assert received.startswith(b"HTTP/1.1 429"), received[:300]
        error = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "rate_limit_error"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while True:  # the server sees the closes
        response = httpx.get(f"{served.url}/health", timeout=5)
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert response.status_code == 200


def test_normal_requests_are_unaffected_by_the_timeouts(served: Served) -> None:
    body = json.dumps({"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 3}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: edge\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    with _connect(served.address) as sock:
        sock.sendall(head + body[:10])
        time.sleep(BODY_TIMEOUT_S * 0.6)  # a pause shorter than the body timeout
        sock.sendall(body[10:])
        sock.settimeout(60)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    with httpx.Client(base_url=served.url, timeout=60) as client:  # idle keep-alive past the header timeout
        first = client.get("/health")
        time.sleep(HEADER_TIMEOUT_S * 1.5)
        second = client.get("/health")
        assert second.status_code == 200
        assert second.extensions["network_stream"] is first.extensions["network_stream"]


# --- the event loop -----------------------------------------------------------------------------------------


def test_health_stays_fast_while_a_multi_megabyte_prompt_is_routed(served: Served, probe_health) -> None:
    words = ["def", "class", "import", "return", "self", "x", "print", "(", ")", ":", "\n", "    ", "foo_bar", "42"]
    prompt = " ".join(words[(i * 7) % len(words)] for i in range(900_000))[:4_000_000]
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    # Timed from another process: this one, hundreds of tests in, has a heap whose garbage collections alone once
    # stalled a probe here for 1.5 s (the gateway's own loop was not the cause).
    with probe_health(served.url, PROBE_INTERVAL_S) as probe:
        response = httpx.post(f"{served.url}/v1/completions", timeout=120, content=body,
                              headers={"content-type": "application/json"})
        time.sleep(1.0)  # probes after the answer too: the prompt's cleanup must not stall the loop either
    assert response.status_code < 500, response.text[:500]
    p99 = probe.quantile(0.99)
    print(f"health: {len(probe.latencies)} probes, p50 {statistics.median(probe.latencies) * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms, max {probe.latencies[-1] * 1e3:.1f} ms; the 4 MB prompt got "
          f"{response.status_code}")
    assert p99 < 0.1, f"/health p99 {p99 * 1e3:.0f} ms while a 4 MB prompt was routed"


@pytest.mark.parametrize("request_id", [b"\xff" * 300, b"caf\xe9-" + b"r" * 100])
def test_a_hostile_request_id_is_replaced_not_echoed(served: Served, request_id: bytes) -> None:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 2},
                               headers=[(b"x-request-id", request_id)])
        assert response.status_code == 200, response.text
        assert client.get("/health").status_code == 200
