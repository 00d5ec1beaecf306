"""`ember serve` end to end: a real gateway + control plane process, real replica processes on loopback, the real
OpenAI client. One server for the whole module (replicas take seconds to start); tests run in file order, and the
later ones change the deployment (replica count, versions) on purpose."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-llama"
ADMIN_KEY = "ember-sk-admin-for-tests"
MODEL = "tiny-llama"
READY_TIMEOUT_S = 120.0


@dataclass
class Served:
    url: str
    api_key: str
    home: Path
    registry: Path
    process: subprocess.Popen[str]
    log: Path
    env: dict[str, str]
    pids: set[int] = field(default_factory=set)

    def client(self, base: str = "/v1", api_key: str | None = None, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + base, api_key=api_key or self.api_key, max_retries=0,
                             timeout=timeout)

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.request(method, self.url + path, headers=headers, timeout=180, **kwargs)

    def deployment(self, name: str = MODEL) -> dict[str, Any]:
        response = self.admin("GET", f"/admin/deployments/{name}")
        assert response.status_code == 200, response.text
        dep = response.json()
        self.pids.update(r["pid"] for r in dep["replicas"] if r["pid"])
        return dep

    def ready_replicas(self, name: str = MODEL) -> list[dict[str, Any]]:
        dep = self.deployment(name)
        return [r for r in dep["replicas"] if r["state"] == "ready" and r["version"] == dep["active_version"]]

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def ember(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def copy_package(dest: Path, *, name: str | None = None, toml_extra: str = "", hooks_extra: str = "") -> Path:
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = (dest / "ember.toml").read_text()
    if name is not None:
        manifest = manifest.replace(f'name = "{MODEL}"', f'name = "{name}"', 1)
    (dest / "ember.toml").write_text(manifest + toml_extra)
    if hooks_extra:
        (dest / "hooks.py").write_text((dest / "hooks.py").read_text() + hooks_extra)
    return dest




@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, stop_serve: Callable[..., None],
           serve_ready_url: Callable[..., str]) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("serve")
    env = {**os.environ, "EMBER_HOME": str(tmp / "home"), "EMBER_REGISTRY": str(tmp / "registry"),
           "EMBER_CACHE": str(tmp / "cache"), "EMBER_ADMIN_KEY": ADMIN_KEY, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    created = ember("keys", "create", "--name", "tests", env=env)
    assert created.returncode == 0, created.stderr
    api_key = created.stdout.strip()
    assert api_key.startswith("ember-sk-")
    log = tmp / "serve.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(EXAMPLE), "--port", "0"], env=env,
                                   stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO)
    server = Served("", api_key, tmp / "home", tmp / "registry", process, log, env)
    try:
        server.url = serve_ready_url(process, log, READY_TIMEOUT_S)
        server.deployment()
        yield server
    finally:
        stop_serve(process, server.pids, server.home)


def chat(client: openai.OpenAI, content: str = "Hello", **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


# --- the OpenAI surface ------------------------------------------------------------------------------------


def test_chat_completion_through_the_gateway(served: Served) -> None:
    reply = chat(served.client(), max_tokens=8, temperature=0)
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 0


def test_streamed_chat_arrives_chunk_by_chunk_and_matches_the_unstreamed_answer(served: Served) -> None:
    client = served.client()
    whole = chat(client, "Tell me a story", max_tokens=12, temperature=0)
    chunks = list(chat(client, "Tell me a story", max_tokens=12, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    assert len(chunks) > 3
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_completions_streamed_and_not(served: Served) -> None:
    client = served.client()
    whole = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.usage is not None and whole.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_models_lists_the_deployment(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_per_model_routes(served: Served) -> None:
    client = served.client(f"/models/{MODEL}/v1")
    assert chat(client, max_tokens=3).usage.completion_tokens == 3
    assert [m.id for m in client.models.list().data] == [MODEL]
    # On /models/NAME/... the body's model may be left out.
    response = httpx.post(f"{served.url}/models/{MODEL}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                          headers={"Authorization": f"Bearer {served.api_key}"}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL and response.json()["usage"]["completion_tokens"] == 2


def test_unknown_model_is_a_404_that_lists_the_models(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        served.client().chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert MODEL in error["message"]
    with pytest.raises(openai.NotFoundError):
        chat(served.client("/models/no-such-model/v1"))


def test_replica_errors_pass_through_with_their_status_and_body(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(served.client(), max_tokens=1, top_p=7.0)
    assert caught.value.body["param"] == "top_p"


def test_api_keys_are_required(served: Served) -> None:
    with pytest.raises(openai.AuthenticationError):
        chat(served.client(api_key="ember-sk-wrong"))
    response = httpx.post(f"{served.url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=10)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.url}/v1/models", timeout=10).status_code == 401
    for headers in ({}, {"Authorization": f"Bearer {served.api_key}"}):  # no key, and a key that is not the admin's
        response = httpx.get(f"{served.url}/admin/deployments", headers=headers, timeout=10)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{served.url}/metrics", timeout=10).status_code == 200


def test_admin_key_serves_the_api_too(served: Served) -> None:
    assert chat(served.client(api_key=ADMIN_KEY), max_tokens=1).usage.completion_tokens == 1


def test_info_reports_selections_and_cold_start_timings(served: Served) -> None:
    response = httpx.get(f"{served.url}/models/{MODEL}/info", headers={"Authorization": f"Bearer {served.api_key}"},
                         timeout=10)
    assert response.status_code == 200, response.text
    info = response.json()
    assert info["name"] == MODEL and info["version"] == "0.1.0" and info["digest"].startswith("sha256:")
    lock = json.loads((EXAMPLE / "ember.lock").read_text())
    assert info["digest"] == lock["digest"]
    assert info["description"].startswith("A 5.0M-parameter Llama") and info["license"] == "Apache-2.0"  # [model]
    assert info["selections"]["attention"]["name"] and info["selections"]["attention"]["reason"]
    assert {"quantization", "speculator", "attention"} <= set(info["selections"])
    assert info["kernel_ops"]["rms_norm"].endswith("torch")  # per kernel op, the impls its engine tries in order
    for phase in ("pull", "load", "quantize", "warmup", "first_token", "replica_start"):
        assert isinstance(info["timings"][phase], float), phase
    assert [r["state"] for r in info["replicas"]] == ["ready"]


def test_info_shows_replica_internals_only_to_the_admin_key_and_replicas_obey_only_the_gateway(
        served: Served) -> None:
    def info_with(key: str) -> dict[str, Any]:
        response = httpx.get(f"{served.url}/models/{MODEL}/info", headers={"Authorization": f"Bearer {key}"},
                             timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    admin = info_with(ADMIN_KEY)
    [replica] = admin["replicas"]
    assert replica["url"].startswith("http://127.0.0.1:") and replica["pid"] > 0 and admin["replica"]["name"] == MODEL
    public = info_with(served.api_key)
    assert public["replicas"] == [{"version": "0.1.0", "state": "ready"}] and "replica" not in public
    text = json.dumps(public)
    assert replica["url"] not in text and str(replica["pid"]) not in text and '"url"' not in text
    assert public["selections"] == admin["selections"] and public["max_model_len"] == admin["max_model_len"]

    # With the URL, a local process still cannot go around the gateway: the replica wants the gateway's secret.
    for method, path in (("POST", "/v1/completions"), ("POST", "/sleep"), ("POST", "/wake"), ("GET", "/info")):
        response = httpx.request(method, replica["url"] + path, json={"model": MODEL, "prompt": "Hi"},
                                 headers={"Authorization": f"Bearer {served.api_key}"}, timeout=10)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_replica_secret", path
    assert chat(served.client(), max_tokens=1).usage.completion_tokens == 1  # the gateway itself gets through


def test_metrics_count_requests_by_model_and_status(served: Served) -> None:
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    ok = re.search(r'ember_gateway_requests_total\{endpoint="chat.completions",model="tiny-llama",status="200"\} '
                   r"(\d+)", text)
    assert ok and int(ok.group(1)) >= 3
    assert 'status="404"' in text and 'status="401"' in text
    assert re.search(r'ember_gateway_upstream_latency_seconds_count\{model="tiny-llama"\} [1-9]', text)
    assert 'ember_gateway_replicas{model="tiny-llama",state="ready"} 1.0' in text


def test_ember_call_streams_an_answer(served: Served) -> None:
    done = ember("call", MODEL, "Hello", "--gateway", served.url, "--api-key", served.api_key, "--max-tokens", "6",
                 env=served.env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    refused = ember("call", MODEL, "Hello", "--gateway", served.url, "--api-key", "ember-sk-wrong", env=served.env)
    assert refused.returncode == 1 and "401" in refused.stderr and "Traceback" not in refused.stderr


def test_ember_call_takes_the_address_serve_prints_and_says_when_no_key_was_given(served: Served) -> None:
    address = served.url.removeprefix("http://")  # 127.0.0.1:PORT, as a newcomer copies it
    done = ember("call", MODEL, "Hello", "--gateway", address, "--api-key", served.api_key, "--max-tokens", "2",
                 env=served.env)
    assert done.returncode == 0, done.stderr
    env = {k: v for k, v in served.env.items() if k != "EMBER_API_KEY"}
    no_key = ember("call", MODEL, "Hello", "--gateway", address, env=env)
    assert no_key.returncode == 1 and "Traceback" not in no_key.stderr
    assert "requires an API key and none was given" in no_key.stderr and "EMBER_API_KEY" in no_key.stderr


# --- replicas: scale, disconnects, drains -------------------------------------------------------------------


def test_redeploying_the_active_version_with_more_replicas_scales_it_and_routes_by_prefix(served: Served) -> None:
    response = served.admin("POST", "/admin/deployments", json={"reference": MODEL, "min_replicas": 2})
    assert response.status_code == 201, response.text
    ready = served.ready_replicas()
    assert len(ready) == 2
    before = {r["id"]: r["served"] for r in ready}
    client = served.client()
    prompt = "Explain what this function does:\n" + "def walk(top):\n    for root, dirs, files in os.walk(top):\n" * 8
    first = chat(client, prompt, max_tokens=1)
    for _ in range(3):  # KV-aware routing: the replica that holds the prompt's blocks gets it again
        again = chat(client, prompt, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert first.usage.prompt_tokens_details is None or not first.usage.prompt_tokens_details.cached_tokens
    after = {r["id"]: r["served"] for r in served.ready_replicas()}
    assert sorted(after[i] - before[i] for i in before) == [0, 4], (before, after)


def replica_metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in {url}/metrics"
    return float(match.group(1))


def kv_blocks_used(served: Served) -> float:
    return sum(replica_metric(r["url"], "ember_kv_blocks_used") for r in served.ready_replicas())


def aborted(served: Served) -> float:
    return sum(replica_metric(r["url"], 'ember_requests_finished_total{finish_reason="abort"}')
               for r in served.ready_replicas())


LONG = {"max_tokens": 1500, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_client_that_disconnects_frees_its_kv_blocks_in_the_replica(served: Served) -> None:
    assert kv_blocks_used(served) == 0
    aborted_before = aborted(served)
    stream = chat(served.client(), "Count to a thousand", stream=True, **LONG)
    chunks = iter(stream)
    for _ in range(5):
        next(chunks)
    assert kv_blocks_used(served) > 0  # the request holds blocks while it runs...
    stream.close()                   # ...and leaving closes the gateway's stream to the replica, which aborts it
    wait_until(lambda: kv_blocks_used(served) == 0, 20, "the replica to free the blocks")
    wait_until(lambda: aborted(served) == aborted_before + 1, 20, "the replica to count the request as aborted")

    # The same for a request that is not streamed: the client gives up waiting for the whole answer.
    with pytest.raises(openai.APITimeoutError):
        chat(served.client(timeout=1.0), "Count again", **LONG)
    wait_until(lambda: aborted(served) == aborted_before + 2, 20, "the replica to abort the second request")
    wait_until(lambda: kv_blocks_used(served) == 0, 20, "the replica to free the blocks")


def test_sigterm_on_a_replica_lets_requests_in_flight_finish_and_sends_new_ones_elsewhere(served: Served) -> None:
    assert len(served.ready_replicas()) == 2
    client = served.client()
    results: dict[int, Any] = {}
    started = threading.Barrier(3)

    def long_stream(i: int) -> None:
        try:
            stream = chat(client, f"Story {i}", stream=True, stream_options={"include_usage": True},
                          **{**LONG, "max_tokens": 400})
            chunks = [next(iter(stream))]
            started.wait(30)
            chunks += list(stream)
            results[i] = chunks
        except Exception as e:
            results[i] = e
            started.abort()

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    started.wait(60)  # both streams are running, one on each replica (round robin)
    busy = wait_until(lambda: [r for r in served.ready_replicas() if r["in_flight"]], 10, "a busy replica")
    victim = busy[0]
    os.kill(victim["pid"], signal.SIGTERM)

    # New requests go to the other replica, or (had none been ready) would get a 503 with Retry-After.
    for _ in range(6):
        try:
            assert chat(client, max_tokens=2).usage.completion_tokens == 2
        except openai.InternalServerError as e:
            assert e.status_code == 503 and e.response.headers.get("retry-after"), e
    for thread in threads:
        thread.join(60)
    for i in range(2):
        assert not isinstance(results[i], Exception), results[i]
        assert results[i][-1].usage.completion_tokens == 400  # finished whole, not cut off by the drain
    # The drained replica exits and the supervisor replaces it.
    wait_until(lambda: len(served.ready_replicas()) == 2 and victim["id"] not in
               {r["id"] for r in served.ready_replicas()}, 60, "a replacement replica")
    assert any(f"replica {victim['id']}" in event for event in served.deployment()["events"])


# --- scale to zero, the bounded queue -----------------------------------------------------------------------


def test_a_cold_deployment_starts_on_the_first_request_and_its_queue_is_bounded(served: Served,
                                                                              tmp_path: Path) -> None:
    from ember.registry import open_registry, push_package

    cold = copy_package(tmp_path / "cold", name="cold-llama", toml_extra="\n[serving]\nmax_queue = 1\n")
    text = (cold / "ember.toml").read_text().replace("prewarm = true", "prewarm = false")
    (cold / "ember.toml").write_text(text)
    push_package(cold, open_registry(str(served.registry)))
    response = served.admin("POST", "/admin/deployments", json={"reference": "cold-llama"})
    assert response.status_code == 201, response.text
    assert response.json()["replicas"] == []  # scaled to zero: nothing starts until a request comes

    client = served.client()
    outcomes: list[Any] = []

    def call() -> None:
        try:
            outcomes.append(client.completions.create(model="cold-llama", prompt="Hi", max_tokens=2))
        except openai.APIStatusError as e:
            outcomes.append(e)

    first = threading.Thread(target=call)
    first.start()
    wait_until(lambda: served.deployment("cold-llama")["waiting"] == 1, 10, "the first request to wait")
    with pytest.raises(openai.RateLimitError) as caught:  # max_queue = 1: the second one is turned away
        client.completions.create(model="cold-llama", prompt="Hi", max_tokens=2)
    assert caught.value.body["code"] == "overloaded"
    first.join(READY_TIMEOUT_S)
    assert len(outcomes) == 1 and not isinstance(outcomes[0], Exception), outcomes
    assert outcomes[0].usage.completion_tokens == 2
    assert "cold start" in " ".join(served.deployment("cold-llama")["events"])

    response = served.admin("DELETE", "/admin/deployments/cold-llama")
    assert response.status_code == 200, response.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="cold-llama", prompt="Hi", max_tokens=2)
    assert served.admin("GET", "/admin/deployments/cold-llama").status_code == 404


# --- versions -----------------------------------------------------------------------------------------------


def info(served: Served) -> dict[str, Any]:
    return httpx.get(f"{served.url}/models/{MODEL}/info", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                     timeout=10).json()


def test_deploy_promote_and_rollback_versions_without_dropping_requests(served: Served, tmp_path: Path) -> None:
    v2 = copy_package(tmp_path / "v2", hooks_extra="\n\n# 0.2.0: the same model with an edited hooks.py\n")
    pushed = ember("push", str(v2), "--version", "0.2.0", "--registry", str(served.registry), env=served.env)
    assert pushed.returncode == 0, pushed.stderr
    assert "1 blob uploaded" in pushed.stdout  # only hooks.py changed
    v1_digest = info(served)["digest"]

    failures: list[BaseException] = []
    stop = threading.Event()

    def traffic() -> None:
        client = served.client()
        while not stop.is_set():
            try:
                chat(client, max_tokens=2)
            except Exception as e:
                failures.append(e)
            time.sleep(0.05)

    background = threading.Thread(target=traffic)
    background.start()
    try:
        deployed = ember("deploy", f"{MODEL}:0.2.0", "--gateway", served.url, "--admin-key", ADMIN_KEY,
                         "--min-replicas", "1", env=served.env, timeout=180)
        assert deployed.returncode == 0, deployed.stderr
        assert "tiny-llama:0.2.0" in deployed.stdout
        wait_until(lambda: {r["version"] for r in served.deployment()["replicas"]} == {"0.2.0"}, 60,
                   "the 0.1.0 replicas to drain and stop")
    finally:
        stop.set()
        background.join(60)
    assert not failures, failures[:3]
    now = info(served)
    assert now["version"] == "0.2.0" and now["digest"] != v1_digest and now["versions"] == ["0.1.0", "0.2.0"]

    promoted = served.admin("POST", f"/admin/deployments/{MODEL}/promote", json={"version": "0.1.0"})
    assert promoted.status_code == 200, promoted.text
    assert info(served)["version"] == "0.1.0" and info(served)["digest"] == v1_digest
    assert chat(served.client(), max_tokens=1).usage.completion_tokens == 1

    rolled = served.admin("POST", f"/admin/deployments/{MODEL}/rollback")
    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["active_version"] == "0.2.0" and rolled.json()["history"] == ["0.1.0"]
    assert chat(served.client(), max_tokens=1).usage.completion_tokens == 1

    unknown = served.admin("POST", f"/admin/deployments/{MODEL}/promote", json={"version": "9.9.9"})
    assert unknown.status_code == 404 and "ember deploy" in unknown.json()["error"]["message"]
    missing = served.admin("POST", "/admin/deployments", json={"reference": "no-such-package"})
    assert missing.status_code == 404 and "no package named" in missing.json()["error"]["message"]


# --- shutdown -----------------------------------------------------------------------------------------------


def test_sigterm_drains_every_replica_and_exits_0(served: Served) -> None:
    pids = {r["pid"] for r in served.deployment()["replicas"]}
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(60) == 0, served.log_tail()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_serve_names_an_unreachable_redis_url_in_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "EMBER_HOME": str(tmp_path)}
    done = ember("serve", "--redis-url", f"redis://127.0.0.1:{port}/0", env=env)
    assert done.returncode == 1
    assert f"--redis-url redis://127.0.0.1:{port}/0:" in done.stderr and "Traceback" not in done.stderr
    bad = ember("serve", env={**env, "EMBER_ROUTING": "random"})
    assert bad.returncode == 1 and "EMBER_ROUTING='random': expected 'kv' or 'round-robin'" in bad.stderr
