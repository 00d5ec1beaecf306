"""Fixtures shared by every test tree."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    # Whatever this run starts dies with it, even when it dies without teardown (see fixtures/reaper.py).
    subprocess.Popen([sys.executable, str(Path(__file__).parent / "fixtures" / "reaper.py"), str(os.getpid())],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    # The engine caches quantized weights under ~/.cache by default: a run must neither read an older checkout's
    # entries nor leave its own behind. Child processes (replicas) inherit the variable.
    if "EMBER_QUANTIZED_CACHE" not in os.environ:
        import tempfile

        os.environ["EMBER_QUANTIZED_CACHE"] = config._ember_quantized_cache = tempfile.mkdtemp(  # type: ignore[attr-defined]
            prefix="ember-test-quantized-")


def pytest_unconfigure(config: pytest.Config) -> None:
    created = getattr(config, "_ember_quantized_cache", None)
    if created is not None:
        import shutil

        shutil.rmtree(created, ignore_errors=True)

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 32,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def write_tiny_package(root: Path, name: str = "tiny", version: str = "0.1.0", extra_toml: str = "",
                       seed: int = 0) -> Path:
    """A small but well-formed package: manifest, config.json and one safetensors file.

    Written with numpy so that tests of the torch-free base install need no torch.
    """
    from safetensors.numpy import save_file

    weights = root / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    (weights / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    rng = np.random.default_rng(seed)
    save_file({"model.embed_tokens.weight": rng.standard_normal((32, 16), dtype=np.float32)},
              str(weights / "model.safetensors"))
    (root / "ember.toml").write_text(f'[model]\nname = "{name}"\nversion = "{version}"\n{extra_toml}')
    return root


@pytest.fixture
def make_package(tmp_path: Path) -> Callable[..., Path]:
    """make_package(name="tiny", version="0.1.0", extra_toml="", subdir=None) -> package dir."""
    counter = iter(range(1_000_000))

    def make(name: str = "tiny", version: str = "0.1.0", extra_toml: str = "", subdir: str | None = None,
             seed: int = 0) -> Path:
        root = tmp_path / (subdir or f"pkg{next(counter)}")
        return write_tiny_package(root, name, version, extra_toml, seed)

    return make


# --- plugin distributions ------------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def readme_plugin_sources() -> dict[str, str]:
    """The files of the plugins in README.md's "Write a plugin" section, by their `# file:` line: a bare name
    belongs to the redaction plugin, "DIST/NAME" to the distribution in folder DIST (e.g. ember-silu-count)."""
    import re

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Write a plugin", 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"```(?:toml|python)\n(.*?)```", section, flags=re.S):
        first, _, rest = block.partition("\n")
        if first.startswith("# file: "):
            files[first.removeprefix("# file: ").strip()] = rest
    return files


def pip_install_target(source: Path, target: Path) -> None:
    """Install a distribution for real (build backend, dist-info, entry points) into `target`."""
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True,
    )


@pytest.fixture(scope="session")
def plugin_dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Site directories, each holding one installed test plugin distribution.

    "redact" and every other README distribution ("ember-silu-count" -> "silu-count") are built from README.md's
    plugin sources, so the README's examples are what is tested.
    """
    root = tmp_path_factory.mktemp("plugin-dists")
    sources = {"techniques": FIXTURES / "ember-test-techniques", "broken": FIXTURES / "ember-broken-plugin",
               "parallel": FIXTURES / "ember-test-parallel", "speculator": FIXTURES / "ember-test-speculator"}
    for name, text in readme_plugin_sources().items():
        dist, _, file_name = name.partition("/") if "/" in name else ("", "", name)  # DIST/path/in/it.py
        dist = dist or "ember-redact"
        readme_src = root / "src" / dist
        (readme_src / file_name).parent.mkdir(parents=True, exist_ok=True)
        (readme_src / file_name).write_text(text)
        sources[dist.removeprefix("ember-")] = readme_src
    sites = {}
    for key, source in sources.items():
        sites[key] = root / f"site-{key}"
        pip_install_target(source, sites[key])
    return sites


@pytest.fixture
def use_plugins(plugin_dists: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """use_plugins("redact", "techniques"): make those distributions importable and discoverable."""
    monkeypatch.delenv("EMBER_DISABLE_PLUGINS", raising=False)

    def use(*keys: str) -> None:
        for key in keys:
            monkeypatch.syspath_prepend(str(plugin_dists[key]))

    return use


# --- a real S3 endpoint ---------------------------------------------------------------------

# Dummy credentials for moto; never ask an instance-metadata service for real ones (that waits for a timeout).
AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """A moto S3 server in its own process on a free loopback port; `stop()` takes it down (mid-run if need be)."""

    def __init__(self, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **AWS_TEST_ENV, **(env or {})})
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=1).close()
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"moto server did not start on {self.url}: {log.read_text()[-2000:]}")
                time.sleep(0.1)

    def client(self):  # -> botocore S3 client, with explicit credentials (it cannot see a test's environment)
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def new_bucket(self, prefix: str = "ember-test") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def start_moto() -> Callable[..., MotoServer]:
    """start_moto(log, env=None) -> a running MotoServer; the caller stops it. (Sub-tree conftests reach the
    class through this fixture: pytest's importlib mode lets no test module import a conftest.)"""
    return MotoServer


@pytest.fixture
def aws_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing the test does can reach a real AWS account or read ~/.aws."""
    for name, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def dead_endpoint() -> str:
    """An endpoint URL on a loopback port that nothing listens on (connection refused at once)."""
    return f"http://127.0.0.1:{free_port()}"


def stop_serve(process: subprocess.Popen | None, replica_pids: set[int], home: Path) -> None:
    """Stop an `ember serve` process (SIGTERM: it drains its replicas), then SIGKILL any of its replicas still there:
    a failed test must not leave replicas behind. Only processes that are replicas under `home` are killed, never
    another that may have taken a pid since."""
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    for pid in replica_pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "ember_platform.replica" in command and str(home) in command:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Launched:
    """An `ember serve` child started by `launch_serve`: its process, log, environment and API key."""

    process: subprocess.Popen[str]
    log: Path
    env: dict[str, str]
    api_key: str


def launch_serve(tmp: Path, package: Path, admin_key: str) -> Launched:
    """Start `ember serve PACKAGE --port 0` with its state under `tmp` and one API key created first (the caller
    waits for it with `serve_ready_url` and stops it with `stop_serve`)."""
    env = {**os.environ, "EMBER_HOME": str(tmp / "home"), "EMBER_REGISTRY": str(tmp / "registry"),
           "EMBER_CACHE": str(tmp / "cache"), "EMBER_ADMIN_KEY": admin_key, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    created = subprocess.run([sys.executable, "-m", "ember", "keys", "create", "--name", "tests"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert created.returncode == 0, created.stderr
    log = tmp / "serve.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(package), "--port", "0"], env=env,
                                   stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO_ROOT)
    return Launched(process, log, env, created.stdout.strip())


@pytest.fixture(name="launch_serve", scope="session")
def launch_serve_fixture() -> Callable[[Path, Path, str], Launched]:
    """launch_serve(tmp, package, admin_key): see `launch_serve`."""
    return launch_serve


@pytest.fixture(name="stop_serve", scope="session")
def stop_serve_fixture() -> Callable[[subprocess.Popen | None, set[int], Path], None]:
    """stop_serve(process, replica_pids, home): see `stop_serve` (a fixture: test modules cannot import conftests)."""
    return stop_serve


def serve_ready_url(process: subprocess.Popen[str], log: Path, timeout: float = 300.0,
                    drain_into: Path | None = None) -> str:
    """The URL an `ember serve` child prints on its ready line (stdout a text pipe), once it does; AssertionError with
    its log otherwise. From then on its stdout is drained in a thread (into `drain_into`, if given): uvicorn's access
    log goes there, and a full pipe would block the gateway's event loop on its next write."""
    import select
    import threading

    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([process.stdout], [], [], 0.5)[0]:
            line = process.stdout.readline()
            if line.startswith("EMBER_SERVE_READY "):
                threading.Thread(target=_drain, args=(process, drain_into), daemon=True).start()
                return line.split()[1]
            if not line and process.poll() is not None:
                break
    raise AssertionError(f"ember serve did not become ready (exit code {process.poll()}):\n{log.read_text()}")


def _drain(process: subprocess.Popen[str], into: Path | None) -> None:
    assert process.stdout is not None
    with open(into or os.devnull, "a") as out:
        for line in process.stdout:
            out.write(line)


@pytest.fixture(name="serve_ready_url", scope="session")
def serve_ready_url_fixture() -> Callable[..., str]:
    """serve_ready_url(process, log, timeout=300, drain_into=None): see `serve_ready_url`."""
    return serve_ready_url


class HealthProbe:
    """`with probe_health(url, interval_s) as probe:` /health is probed from another process (fixtures/health_probe.py)
    until the block ends; then `probe.latencies` holds each probe's delay from when it was due, in seconds."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url, self.interval_s = url, interval_s
        self.latencies: list[float] = []

    def __enter__(self) -> HealthProbe:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "fixtures" / "health_probe.py"), self.url,
             str(self.interval_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        first = self.process.stdout.readline()
        assert first.strip() == "probing", f"the /health probe did not start (exit code {self.process.poll()})"
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self.process.communicate(timeout=60)  # closes its stdin: it stops and prints what it measured
        assert self.process.returncode == 0, f"a /health probe failed (exit code {self.process.returncode})"
        self.latencies = sorted(json.loads(out))

    def quantile(self, q: float) -> float:
        return self.latencies[min(len(self.latencies) - 1, int(len(self.latencies) * q))]


@pytest.fixture(name="probe_health", scope="session")
def probe_health_fixture() -> Callable[[str, float], HealthProbe]:
    """probe_health(url, interval_s): see `HealthProbe`."""
    return HealthProbe


# --- speculative decoding ------------------------------------------------------------------

@pytest.fixture(name="spec_distribution", scope="session")
def spec_distribution_fixture() -> ModuleType:
    """The speculation distribution harness, tests/platform/engine/spec_distribution.py, as a module (tests/ is not
    on sys.path under --import-mode=importlib): `spec_distribution.check_distribution(llm, prompt, params)`."""
    import importlib.util

    name = "ember_tests_spec_distribution"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parent / "platform" / "engine" / "spec_distribution.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(name="run_preempted", scope="session")
def run_preempted_fixture() -> Callable[..., list[list[int]]]:
    """`run_preempted(engine, prompts, params)`: adds the prompts as requests "0", "1", ..., steps the engine until
    all finish, asserts that at least one request was preempted (the engine's KV pool must be too small for all of
    them at once), and returns each request's generated tokens in prompt order."""

    def run(engine: Any, prompts: Sequence[Any], params: Any) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        preempted = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            preempted = max(preempted, max((r.num_preemptions for r in engine.scheduler.running), default=0))
        assert preempted > 0, "no request was preempted: the KV pool is large enough for all of them"
        return [tokens[str(i)] for i in range(len(prompts))]

    return run
