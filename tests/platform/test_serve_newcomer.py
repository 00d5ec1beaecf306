"""What a newcomer meets with `ember serve`: an edited package is served with `--dev` (a content-derived version)
instead of a dead end, and a plain Hugging Face checkpoint is served with a generated manifest. The pushes run for
real against a local registry; the last test serves a checkpoint end to end and asks it through the openai client."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from ember.registry import LocalRegistry, VersionConflict
from ember_platform.serve import _push

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-llama"


def edited_copy(tmp_path: Path) -> Path:
    package = tmp_path / "pkg"
    shutil.copytree(EXAMPLE, package, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def test_an_edited_package_names_the_dev_mode_and_dev_mode_serves_each_edit_as_its_own_version(
        tmp_path: Path) -> None:
    registry = LocalRegistry(tmp_path / "registry")
    package = edited_copy(tmp_path)
    said: list[str] = []
    _push(package, registry, tmp_path / "home", False, said.append)
    (package / "hooks.py").write_text((package / "hooks.py").read_text() + "\n# an edit\n")

    with pytest.raises(VersionConflict) as refused:
        _push(package, registry, tmp_path / "home", False, said.append)
    message = str(refused.value)
    assert f"ember serve --dev {package}" in message and "--force" not in message

    first = _push(package, registry, tmp_path / "home", True, said.append).lock
    assert first.version == "0.1.0+dev." + first.digest.removeprefix("sha256:")[:12]
    again = _push(package, registry, tmp_path / "home", True, said.append)
    assert again.already_pushed and again.lock.version == first.version  # the same files are the same version
    (package / "hooks.py").write_text((package / "hooks.py").read_text() + "# another edit\n")
    second = _push(package, registry, tmp_path / "home", True, said.append).lock
    assert second.version != first.version
    assert {first.version, second.version} <= set(registry.list_versions("tiny-llama"))


def test_ember_push_still_offers_force(tmp_path: Path) -> None:
    package = edited_copy(tmp_path)
    env = {**os.environ, "EMBER_REGISTRY": str(tmp_path / "registry")}
    push = [sys.executable, "-m", "ember", "push", str(package)]
    assert subprocess.run(push, env=env, capture_output=True, text=True, timeout=120).returncode == 0
    (package / "hooks.py").write_text((package / "hooks.py").read_text() + "\n# an edit\n")
    refused = subprocess.run(push, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "or --force" in refused.stderr and "Traceback" not in refused.stderr


def test_a_plain_checkpoint_is_pushed_through_a_generated_package(tmp_path: Path) -> None:
    checkpoint = tmp_path / "My-Checkpoint"
    shutil.copytree(EXAMPLE / "weights", checkpoint)
    said: list[str] = []
    pushed = _push(checkpoint, LocalRegistry(tmp_path / "registry"), tmp_path / "home", False, said.append)
    assert pushed.lock.name == "my-checkpoint" and "+dev." in pushed.lock.version
    assert "generated manifest" in said[0] and f"ember init PACKAGE_DIR --from {checkpoint}" in said[0]
    assert not (checkpoint / "ember.toml").exists()  # the user's checkpoint is left as it was
    # The checkpoint changes: the next serve follows it, under another content version.
    (checkpoint / "generation_config.json").write_text('{"max_new_tokens": 8}')
    again = _push(checkpoint, LocalRegistry(tmp_path / "registry"), tmp_path / "home", False, said.append)
    assert again.lock.version != pushed.lock.version


def test_ember_serve_answers_from_a_plain_hugging_face_checkpoint(
        tmp_path: Path, stop_serve: Callable[..., None], serve_ready_url: Callable[..., str]) -> None:
    checkpoint = tmp_path / "hf-tiny"
    shutil.copytree(EXAMPLE / "weights", checkpoint)
    env = {**os.environ, "EMBER_HOME": str(tmp_path / "home"), "EMBER_REGISTRY": str(tmp_path / "registry"),
           "EMBER_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(checkpoint), "--port", "0",
                                    "--no-auth"], env=env, stdout=subprocess.PIPE, stderr=log_file, text=True)
    try:
        url = serve_ready_url(process, log, 120.0)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["hf-tiny"]
        answer = client.completions.create(model="hf-tiny", prompt="def main(", max_tokens=4)
        assert answer.choices[0].text
    finally:
        stop_serve(process, set(), tmp_path / "home")
