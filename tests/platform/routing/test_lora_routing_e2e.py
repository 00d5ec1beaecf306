"""LoRA-aware routing end to end: a real `redis-server`, two gateways (`ember serve --redis-url`) and two replica
processes of the example model with two PEFT adapters, the official `openai` client.

The topology of bench/bench_routing.py (and test_routing_e2e.py, whose helpers these are a trimmed copy of: pytest's
importlib mode lets no test module import another): gateway A runs the replicas, which publish the adapters resident
in their engines to Redis; gateway B runs none and routes through the shared tables alone. With each adapter
resident on one replica only, every request for `MODEL:ADAPTER` through either gateway lands on that replica.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ember_platform.routing import ReplicaState
from ember_platform.routing.redis_tables import RedisTables

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-llama"
MODEL = "tiny-llama"
ADAPTERS = ("sql", "docs")
READY_TIMEOUT_S = 180.0


def make_adapters(root: Path) -> Path:
    """Two PEFT adapters of the example model, made at test time (random init, so that each changes the output)."""
    import peft
    import torch
    import transformers

    for seed, name in enumerate(ADAPTERS):
        base = transformers.AutoModelForCausalLM.from_pretrained(EXAMPLE / "weights")
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        model.save_pretrained(root / name)
    return root


def package_copy(dest: Path, adapters: Path, *, replicas: int) -> Path:
    """The example package with `replicas` replicas at deploy time (0: scaled to zero), no autoscaling, and the
    adapters as its `[[lora]]` entries."""
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("__pycache__", "ember.lock"))
    shutil.copytree(adapters, dest / "adapters")
    manifest = dest / "ember.toml"
    text = manifest.read_text()
    text = re.sub(r"(?m)^min_replicas = .*$", f"min_replicas = {replicas}", text)
    text = re.sub(r"(?m)^max_replicas = .*$", f"max_replicas = {max(1, replicas)}", text)
    text = re.sub(r"(?m)^prewarm = .*$", f"prewarm = {'true' if replicas else 'false'}", text)
    text = re.sub(r"(?m)^target_concurrency = .*$", "target_concurrency = 1000", text)
    text += "".join(f'\n[[lora]]\nname = "{name}"\npath = "adapters/{name}"\n' for name in ADAPTERS)
    manifest.write_text(text)
    return dest


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class Gateway:
    """`ember serve PACKAGE --redis-url URL` in a subprocess with its own home, registry and cache."""

    def __init__(self, name: str, package: Path, workdir: Path, redis_url: str) -> None:
        self.name, self.package, self.redis_url = name, package, redis_url
        self.home = workdir / name / "home"
        self.log_path = workdir / name / "serve.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.url = ""
        self.process: subprocess.Popen[str] | None = None
        self.pids: set[int] = set()
        self._lines: queue.Queue[str | None] = queue.Queue()

    def launch(self) -> Gateway:
        env = {**os.environ, "EMBER_HOME": str(self.home), "EMBER_REGISTRY": str(self.home.parent / "registry"),
               "EMBER_CACHE": str(self.home.parent / "cache"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "EMBER_ROUTING": "kv"}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ember", "serve", str(self.package), "--no-auth", "--host", "127.0.0.1",
                 "--port", "0", "--redis-url", self.redis_url], env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        return self

    def _read_stdout(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:  # keeps the pipe from filling up
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self) -> Gateway:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith("EMBER_SERVE_READY "):
                self.url = line.split()[1].rstrip("/")
                self.replicas()
                return self
        log = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
        raise AssertionError(f"gateway {self.name} did not become ready:\n{log}")

    def client(self, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=timeout)

    def replicas(self) -> list[dict[str, Any]]:
        """The replicas this gateway's control plane runs."""
        response = httpx.get(f"{self.url}/admin/deployments/{MODEL}", timeout=30)
        assert response.status_code == 200, response.text
        replicas = response.json()["replicas"]
        self.pids.update(r["pid"] for r in replicas if r["pid"])
        return replicas

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for pid in self.pids:  # a failed test must not leave replicas behind
            kill_if_ours(pid, self.home)


def kill_if_ours(pid: int, home: Path) -> None:
    """SIGKILL a replica of this gateway, and nothing else that may have taken its pid since."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return
    if "ember_platform.replica" in command and str(home) in command:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def topology(own_redis: Any, tmp_path: Path) -> Iterator[tuple[Gateway, Gateway, RedisTables]]:
    adapters = make_adapters(tmp_path / "adapters")
    a = Gateway("a", package_copy(tmp_path / "pkg-a", adapters, replicas=2), tmp_path, own_redis.url)
    b = Gateway("b", package_copy(tmp_path / "pkg-b", adapters, replicas=0), tmp_path, own_redis.url)
    tables = RedisTables.from_url(own_redis.url)  # what every gateway and replica shares
    try:
        a.launch().wait_ready()
        b.launch().wait_ready()
        wait_until(lambda: len(routed(tables)) == 2, 30, "2 replicas in the routing tables")
        assert b.replicas() == []  # B runs none: everything it serves goes to A's replicas through the tables
        yield a, b, tables
    finally:
        b.stop()
        a.stop()
        tables.close()


def routed(tables: RedisTables) -> dict[str, str]:
    """Replica id -> url of the ready replicas the routing tables hold."""
    return {v.replica_id: v.record.url for v in tables.snapshot(MODEL) if v.record.state == ReplicaState.READY}


def finished(url: str) -> int:
    """Requests the replica at `url` has served (its own count)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(sum(float(m.group(1)) for m in
                   re.finditer(r"^ember_requests_finished_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)))


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # transformers, inside peft
def test_adapter_requests_land_on_the_replica_that_holds_the_adapter(topology: Any) -> None:
    a, b, tables = topology
    urls = routed(tables)
    first, second = sorted(urls)
    home = {"sql": first, "docs": second}

    # Make each adapter resident on one replica only, by asking that replica directly.
    for adapter, rid in home.items():
        reply = httpx.post(f"{urls[rid]}/v1/completions", json={"model": f"{MODEL}:{adapter}", "prompt": "x = 1",
                                                                 "max_tokens": 1}, timeout=60)
        assert reply.status_code == 200, reply.text

    def adapters() -> dict[str, frozenset[str]]:
        return {v.replica_id: v.record.adapters for v in tables.snapshot(MODEL)}

    wait_until(lambda: adapters() == {first: {"sql"}, second: {"docs"}}, 10, "the replicas to publish their adapters")

    # Through both gateways, with prompts no replica holds: each request lands where its adapter is resident (the
    # other replica would have to load it first, which the lora scorer prices at its load time).
    before = {rid: finished(url) for rid, url in urls.items()}
    sent = dict.fromkeys(urls, 0)
    for i in range(12):
        adapter = ADAPTERS[i % 2]
        gateway = (a, b)[(i // 2) % 2]
        reply = gateway.client().completions.create(model=f"{MODEL}:{adapter}", prompt=f"def handler_{i}(request):",
                                                    max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
        sent[home[adapter]] += 1
    assert {rid: finished(url) - before[rid] for rid, url in urls.items()} == sent
    assert adapters() == {first: {"sql"}, second: {"docs"}}  # neither replica had to load the other's adapter
