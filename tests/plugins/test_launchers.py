"""Launchers (ember_launchers): the built-in "local" one, the choice of launcher, and a third-party launcher
plugin (README.md's spec-log, installed for real) that `ember serve --launcher` demonstrably runs replicas with."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.errors import EmberError
from ember.launch import LaunchError, LaunchSettings, ReplicaSpec, Resources
from ember.plugins import PluginHost
from ember_platform.control.launchers import build_launcher
from ember_plugins.launchers.local import LocalProcessLauncher

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-llama"
DIGEST = "sha256:" + "0" * 64


def spec(**fields: Any) -> ReplicaSpec:
    return ReplicaSpec(**{"deployment": "tiny-llama", "version": "0.1.0", "digest": DIGEST, "registry_url": "/r",
                          "replica_id": "r1", "secret": "s3cret", **fields})


def test_hook_ember_launchers(use_plugins: Callable[..., None]) -> None:
    use_plugins("spec-log")
    launchers = PluginHost().techniques.of_kind("launcher")
    assert launchers["local"].plugin == "launcher-local" and launchers["spec-log"].plugin == "spec-log"
    assert set(PluginHost(disabled={"spec-log"}).techniques.of_kind("launcher")) == {"local"}


def test_an_unknown_launcher_is_refused_naming_the_installed_ones(tmp_path: Path) -> None:
    with pytest.raises(EmberError, match=r"unknown launcher 'ray' \(installed: local\)"):
        build_launcher("ray", LaunchSettings(home=tmp_path))
    # `ember serve` refuses it before it pushes or listens: one line, exit code 1.
    env = {**os.environ, "EMBER_HOME": str(tmp_path / "home"), "EMBER_REGISTRY": str(tmp_path / "registry")}
    done = subprocess.run([sys.executable, "-m", "ember", "serve", "--launcher", "ray", "--port", "0", "--no-auth"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 1 and "unknown launcher 'ray' (installed: local)" in done.stderr, done.stderr
    assert not (tmp_path / "registry").exists()


def test_the_local_launcher_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"unknown option\(s\) colour"):
        build_launcher("local", LaunchSettings(home=tmp_path, options={"colour": "red"}))
    launcher = build_launcher("local", LaunchSettings(home=tmp_path, options={"gpus": "0,1"}))
    assert isinstance(launcher, LocalProcessLauncher) and launcher.free_gpus == [0, 1]

    async def start(s: ReplicaSpec) -> None:
        await launcher.start(s)

    with pytest.raises(LaunchError, match="not supported yet: role 'prefill'"):
        asyncio.run(start(spec(role="prefill")))
    with pytest.raises(LaunchError, match=r"needs 3 GPU\(s\), 2 of this launcher's are free"):
        asyncio.run(start(spec(resources=Resources(gpus=3))))
    assert launcher.free_gpus == [0, 1]  # nothing was taken by the refused starts


def test_the_local_launcher_never_puts_the_secret_on_the_command_line(tmp_path: Path) -> None:
    command = LocalProcessLauncher(log_dir=tmp_path / "logs").command(spec(overrides={"max_num_seqs": "4"}))
    assert "s3cret" not in " ".join(command)
    assert command[command.index("--digest") + 1] == DIGEST and "--package" not in command
    assert command[command.index("--reference") + 1] == "tiny-llama:0.1.0"
    assert command[command.index("--override") + 1] == "max_num_seqs=4"


def test_ember_serve_runs_its_replicas_with_a_third_party_launcher(
        tmp_path: Path, plugin_dists: dict[str, Path], serve_ready_url: Callable[..., str],
        stop_serve: Callable[..., None]) -> None:
    """README's spec-log plugin, installed as a real distribution, is chosen with --launcher: a request is served
    by the replica it started, and it recorded the ReplicaSpec it got (registry reference and digest, role)."""
    record = tmp_path / "specs.jsonl"
    home = tmp_path / "home"
    env = {**os.environ, "EMBER_HOME": str(home), "EMBER_REGISTRY": str(tmp_path / "registry"),
           "EMBER_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(plugin_dists["spec-log"]), os.environ.get("PYTHONPATH", "")])}
    env.pop("EMBER_DISABLE_PLUGINS", None)
    log = tmp_path / "serve.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "ember", "serve", str(EXAMPLE), "--port", "0", "--no-auth",
             "--launcher", "spec-log", "--launcher-option", f"log={record}"],
            env=env, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO)
    pids: set[int] = set()
    try:
        url = serve_ready_url(process, log, 300)
        answer = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2},
                            timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2
        deployment = httpx.get(f"{url}/admin/deployments/tiny-llama", timeout=30).json()
        [replica] = deployment["replicas"]
        pids.add(replica["pid"])
        assert replica["launcher"]["launcher"] == "spec-log"  # its describe(): the handle is the plugin's

        [spec_seen] = [json.loads(line) for line in record.read_text().splitlines()]
        assert spec_seen == {"reference": "tiny-llama:0.1.0", "digest": deployment["digest"],
                             "registry": str(tmp_path / "registry"), "role": "both", "gpus": 0,
                             "replica_id": replica["id"]}
        # The replica was told the registry reference and digest, not a path, and checked the package out itself.
        command = Path(replica["launcher"]["log"]).read_text().splitlines()[0]
        assert f"--reference tiny-llama:0.1.0 --digest {deployment['digest']}" in command
        assert "--package " not in command
    finally:
        stop_serve(process, pids, home)
