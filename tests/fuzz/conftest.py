"""The fuzz suite's server and oracle: one real `ember serve` of the example package on loopback (keys on, as in
production) for the whole session, and the property every answer of it must have.

Budgets: EMBER_FUZZ_SECONDS bounds the schema-driven HTTP campaign (default 30 s, for CI); EMBER_FUZZ_REPORT, if
set, names a JSON file the campaigns append their figures to (bench/README.md's fuzz section comes from one)."""

from __future__ import annotations

import builtins
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-llama"
MODEL = "tiny-llama"
ADMIN_KEY = "ember-sk-admin-for-fuzz"
READY_TIMEOUT_S = 180.0


@dataclass
class Gateway:
    url: str
    api_key: str
    log: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])






@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory, stop_serve: Callable[..., None],
            serve_ready_url: Callable[..., str]) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("fuzz-serve")
    env = {**os.environ, "EMBER_HOME": str(tmp / "home"), "EMBER_REGISTRY": str(tmp / "registry"),
           "EMBER_CACHE": str(tmp / "cache"), "EMBER_ADMIN_KEY": ADMIN_KEY, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    created = subprocess.run([sys.executable, "-m", "ember", "keys", "create", "--name", "fuzz"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=REPO)
    assert created.returncode == 0, created.stderr
    log = tmp / "serve.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(EXAMPLE), "--port", "0"], env=env,
                                   stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO)
    pids: set[int] = set()
    try:
        server = Gateway(serve_ready_url(process, log, READY_TIMEOUT_S, drain_into=tmp / "serve.stdout"),
                         created.stdout.strip(), log)
        yield server
        with httpx.Client(timeout=30) as client:  # its replicas, so that none outlives a crashed run
            response = client.get(f"{server.url}/admin/deployments/{MODEL}",
                                   headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            if response.status_code == 200:
                pids.update(r["pid"] for r in response.json().get("replicas", []) if r.get("pid"))
    finally:
        stop_serve(process, pids, tmp / "home")


# --- the property -------------------------------------------------------------------------------------------------

# Names a response body must never show: every exception class Python has built in, and those of the libraries on
# the request path. A model's *generated* text may say "ValueError" (tiny-llama writes Python): only error bodies
# and SSE error events are searched.
EXCEPTION_NAMES = sorted({name for name, value in vars(builtins).items()
                          if isinstance(value, type) and issubclass(value, BaseException)
                          and name not in ("Exception", "BaseException")}
                         | {"ValidationError", "JSONDecodeError", "HTTPException", "ProtocolError", "ControlError",
                            "RemoteProtocolError", "ReadTimeout", "ConnectError", "PydanticCustomError",
                            "SamplingParamsError", "EmberError", "PackageError", "ClientDisconnect",
                            "CancelledError", "IncompleteRead", "UnicodeEncodeError", "UnicodeDecodeError"})
_LEAK = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]+\.py\", line \d+|\b(?:"
                   + "|".join(map(re.escape, EXCEPTION_NAMES)) + r")\b")
ERROR_KEYS = {"message", "type", "param", "code"}


def violations(status: int, headers: Any, body: bytes) -> list[str]:
    """What is wrong with one answer, as short class names ("5xx", "not an OpenAI error object", ...); empty
    when it has the property: no 5xx but a 503 with Retry-After, every non-2xx an OpenAI error object, no
    exception name or traceback in an error body."""
    problems = []
    if status >= 500 and not (status == 503 and "retry-after" in {k.lower() for k in headers}):
        problems.append(f"{status}" + (" without Retry-After" if status == 503 else ""))
    text = body.decode("utf-8", "replace")
    if status >= 300:
        try:
            doc = json.loads(text)
            error = doc.get("error") if isinstance(doc, dict) else None
            ok = isinstance(error, dict) and set(error) >= ERROR_KEYS and isinstance(error["message"], str)
        except ValueError:
            ok = False
        if not ok:
            problems.append(f"{status}: not an OpenAI error object")
        if _LEAK.search(text):
            problems.append(f"{status}: exception name or traceback in the body")
    else:
        for line in text.splitlines():  # a stream's error events: `data: {"error": ...}`
            if line.startswith("data: {\"error\"") and _LEAK.search(line):
                problems.append(f"{status}: exception name or traceback in a stream's error event")
                break
    return problems


@dataclass
class Campaign:
    """Counts of one campaign: inputs tried, answers by status, and the property's violations by class (with the
    first few inputs of each, to reproduce them)."""

    name: str
    started: float = field(default_factory=time.monotonic)
    tried: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: dict[str, list[str]] = field(default_factory=dict)

    def record(self, status: int, headers: Any, body: bytes, what: str) -> list[str]:
        self.tried += 1
        self.statuses[status] += 1
        found = violations(status, headers, body)
        for problem in found:
            examples = self.failures.setdefault(problem, [])
            if len(examples) < 3:
                examples.append(f"{what[:300]} -> {body[:300]!r}")
        return found

    def record_transport_error(self, error: Exception, what: str) -> None:
        # The connection broke or timed out without an answer: as bad as a 5xx for a client.
        self.tried += 1
        self.statuses[0] += 1
        self.failures.setdefault(f"no answer ({type(error).__name__})", []).append(what[:300])

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500 or status == 0)

    def summary(self) -> dict[str, Any]:
        return {"campaign": self.name, "inputs": self.tried, "5xx": self.server_errors,
                "5xx_other_than_503_with_retry_after": sum(
                    len(v) for k, v in self.failures.items() if k[:1] == "5" and "error object" not in k),
                "statuses": dict(sorted(self.statuses.items())), "seconds": round(time.monotonic() - self.started, 1),
                "violations": {k: v for k, v in sorted(self.failures.items())}}

    def report(self) -> dict[str, Any]:
        """Print the figures (run pytest with -s to see them) and append them to $EMBER_FUZZ_REPORT."""
        summary = self.summary()
        print(f"\nFUZZ {self.name}: {summary['inputs']} inputs tried, {summary['5xx']} 5xx seen, "
              f"statuses {summary['statuses']}, {summary['seconds']} s")
        for problem, examples in summary["violations"].items():
            print(f"  VIOLATION {problem}: e.g. {examples[0]}")
        if path := os.environ.get("EMBER_FUZZ_REPORT"):
            with open(path, "a") as out:
                out.write(json.dumps(summary) + "\n")
        return summary


@pytest.fixture(name="campaign", scope="session")
def campaign_fixture() -> type[Campaign]:
    """Campaign(name): see `Campaign` (a fixture: test modules cannot import a conftest)."""
    return Campaign


def assert_healthy(server: Gateway) -> None:
    """The server still answers: /health at once, and a normal completion (through the official client)."""
    import openai

    response = httpx.get(f"{server.url}/health", timeout=10)
    assert response.status_code == 200, response.text
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=3, timeout=60)
    reply = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=4, temperature=0)
    assert reply.choices[0].text is not None


@pytest.fixture(name="assert_healthy", scope="session")
def assert_healthy_fixture() -> Callable[[Gateway], None]:
    return assert_healthy
