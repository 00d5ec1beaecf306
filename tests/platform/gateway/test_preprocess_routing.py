"""`ember_preprocess_request` runs in the gateway, before KV-aware routing hashes the prompt: end to end through a real
`ember serve` (gateway, in-process routing tables) and two real replica processes of a package whose hooks.py
prepends a long system prompt to every chat.

Two chats that share nothing as the client wrote them share that system prompt as the model sees it. Hashing the
client's text, the router saw two prompts without a common block and sent the second to the other replica (ties
alternate between replicas, routing.router): it prefilled the system prompt again. Hashing the rewritten prompt, the
second goes to the replica that holds it and reuses its blocks. The hook writes one line per call to a file, so the
test also sees that it ran once per request, in the gateway, and in a replica only for a request that did not come
from the gateway."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-llama"
MODEL = "tiny-llama"
SECRET = "replica-secret-for-tests"
BLOCK = 16  # the example's kv_block_size

HOOKS = '''
import os

from ember import hookimpl

SYSTEM = "You are a careful reviewer of Python code. " + " ".join(
    f"Rule {i}: read every line of the function, name what it returns, and keep the answer short." for i in range(12))


@hookimpl
def ember_preprocess_request(request, manifest):
    with open(CALLS, "a") as calls:
        calls.write(f"{os.getpid()}\\n")
    messages = request.get("messages") or []
    if messages and messages[-1].get("content") == "boom":
        raise ValueError("this hook refuses 'boom'")
    if messages and messages[0].get("role") != "system":
        return {**request, "messages": [{"role": "system", "content": SYSTEM}, *messages]}
    return None
'''


class Served:
    def __init__(self, url: str, process: subprocess.Popen[str], home: Path, calls: Path, log: Path) -> None:
        self.url, self.process, self.home, self.calls, self.log = url, process, home, calls, log
        self.pids: set[int] = set()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def replicas(self) -> list[dict[str, Any]]:
        dep = httpx.get(f"{self.url}/admin/deployments/{MODEL}", timeout=30).json()
        self.pids.update(r["pid"] for r in dep["replicas"] if r["pid"])
        return [r for r in dep["replicas"] if r["state"] == "ready"]

    def hook_calls(self) -> list[int]:
        return [int(line) for line in self.calls.read_text().split()] if self.calls.exists() else []


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, stop_serve: Callable[..., None],
           serve_ready_url: Callable[..., str]) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("preprocess")
    package = tmp / "package"
    shutil.copytree(EXAMPLE, package, ignore=shutil.ignore_patterns("__pycache__", "ember.lock"))
    manifest = (package / "ember.toml").read_text()
    (package / "ember.toml").write_text(manifest.replace("min_replicas = 0", "min_replicas = 2", 1))
    calls = tmp / "hook-calls.txt"
    (package / "hooks.py").write_text(f"CALLS = {str(calls)!r}\n" + HOOKS)
    env = {**os.environ, "EMBER_HOME": str(tmp / "home"), "EMBER_REGISTRY": str(tmp / "registry"),
           "EMBER_CACHE": str(tmp / "cache"), "EMBER_REPLICA_SECRET": SECRET, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    log = tmp / "serve.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(package), "--port", "0", "--no-auth"],
                                   env=env, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO)
    server = Served("", process, tmp / "home", calls, log)
    try:
        server.url = serve_ready_url(process, log, 180)
        deadline = time.monotonic() + 120
        while len(server.replicas()) < 2:
            assert time.monotonic() < deadline, f"two replicas never became ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield server
    finally:
        stop_serve(process, server.pids, server.home)


def chat(served: Served, content: str) -> Any:
    return served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                   max_tokens=1, temperature=0)


def cached(reply: Any) -> int:
    details = reply.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


def served_by(served: Served) -> dict[str, int]:
    return {r["id"]: r["served"] for r in served.replicas()}


def test_a_rewritten_prompt_routes_to_the_replica_that_holds_its_prefix(served: Served) -> None:
    before = served_by(served)
    first = chat(served, "Hi")
    # The system prompt is many blocks: the model saw it, so the hook's rewrite reached the replica.
    assert first.usage.prompt_tokens > 8 * BLOCK and cached(first) == 0
    after_first = served_by(served)
    (holder,) = [rid for rid in after_first if after_first[rid] == before[rid] + 1]
    for content in ("Yo", "Why?", "Ok"):  # nothing in common with "Hi" as sent, the system prompt as seen
        reply = chat(served, content)
        assert cached(reply) >= 8 * BLOCK, f"{content!r} was prefilled again: {reply.usage}"
    after = served_by(served)
    assert after[holder] == after_first[holder] + 3 and sum(after.values()) == sum(after_first.values()) + 3
    # Once per request, in the gateway: the replicas trusted the gateway's word that the hooks had run.
    assert served.hook_calls() == [served.process.pid] * 4


def test_a_failing_hook_is_a_500_that_names_it_and_the_gateway_serves_on(served: Served) -> None:
    with pytest.raises(openai.InternalServerError) as refused:
        chat(served, "boom")
    error = refused.value.body
    assert refused.value.status_code == 500 and error["code"] == "request_hook_failed", error
    assert "package hooks.py" in error["message"] and "this hook refuses 'boom'" in error["message"], error
    assert cached(chat(served, "Hi again")) >= 8 * BLOCK


def test_a_replica_runs_the_hooks_for_a_request_that_did_not_come_from_its_gateway(served: Served) -> None:
    replica = served.replicas()[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    calls = len(served.hook_calls())
    # The gateway's header without the replica secret: refused before anything runs.
    assert httpx.post(f"{replica['url']}/v1/chat/completions", json=body, timeout=60,
                      headers={"x-ember-preprocessed": f"{MODEL}:0.1.0"}).status_code == 401
    # With the secret but a header that names no version of this replica (or none): the replica runs the hooks.
    auth = {"Authorization": f"Bearer {SECRET}"}
    for marker in ({"x-ember-preprocessed": "someone-else:1"}, {}):
        reply = httpx.post(f"{replica['url']}/v1/chat/completions", json=body, headers={**auth, **marker}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] > 8 * BLOCK, reply.text
    assert served.hook_calls()[calls:] == [replica["pid"]] * 2


@pytest.mark.parametrize("number", [b"1e999", b"-1e999", b"NaN", b"1" + b"0" * 400 + b".5"])
def test_a_number_json_cannot_encode_is_a_400_naming_it_before_any_hook_runs(served: Served, number: bytes) -> None:
    # A hook that rewrites such a body could not send it on (JSON has no infinity): the edge refuses it first,
    # naming the field, where it was once a 500 blaming the hook (found by tests/fuzz/test_http_hostile.py).
    calls = len(served.hook_calls())
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": %s}' % (
        MODEL.encode(), number)
    reply = httpx.post(f"{served.url}/v1/chat/completions", content=body, timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "max_tokens" and "finite" in reply.json()["error"]["message"]
    assert len(served.hook_calls()) == calls
