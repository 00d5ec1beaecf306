"""API keys: stored only as hashes, verified against every stored hash, managed by `ember keys`; the gateway's
modules stay torch-free."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ember.errors import EmberError
from ember_platform.gateway.auth import KEY_PREFIX, Authenticator, KeyStore


def test_keys_are_stored_only_as_sha256_hashes(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.json")
    key = store.create("ci")
    assert key.startswith(KEY_PREFIX) and len(key) > len(KEY_PREFIX) + 40
    text = (tmp_path / "keys.json").read_text()
    assert key not in text
    [record] = json.loads(text)["keys"]
    assert record["name"] == "ci" and record["sha256"] == hashlib.sha256(key.encode()).hexdigest()
    assert record["created"] > 0 and record["admin"] is False
    assert stat.S_IMODE(os.stat(tmp_path / "keys.json").st_mode) == 0o600


def test_verify_and_revoke_by_name_or_value(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.json")
    first, second = store.create("a"), store.create()
    assert store.verify(first).name == "a"
    assert store.verify(second).name == "key-1"
    assert store.verify(first + "x") is None and store.verify("") is None
    with pytest.raises(EmberError, match="exists already"):
        store.create("a")
    assert [r.name for r in store.revoke("a")] == ["a"]
    assert store.verify(first) is None
    assert [r.name for r in store.revoke(second)] == ["key-1"]
    with pytest.raises(EmberError, match="no key named"):
        store.revoke("a")


def test_a_running_gateway_sees_keys_created_later(tmp_path: Path) -> None:
    gateway_view = KeyStore(tmp_path / "keys.json")
    assert gateway_view.verify("ember-sk-anything") is None
    key = KeyStore(tmp_path / "keys.json").create("late")  # e.g. `ember keys create` in another process
    assert gateway_view.verify(key).name == "late"


def test_admin_key_generated_once_or_taken_from_the_environment(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.json")
    admin = store.ensure_admin_key()
    assert admin is not None and store.ensure_admin_key() is None  # printed once, never again
    user = store.create("user")
    auth = Authenticator(store, admin_key="ember-sk-from-env")
    assert auth.authenticate(admin).admin
    assert auth.authenticate("ember-sk-from-env").admin
    assert not auth.authenticate(user).admin
    assert auth.authenticate("ember-sk-nope") is None


def run_ember(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember", *args], env={**os.environ, "EMBER_HOME": str(home)},
                          capture_output=True, text=True, timeout=60)


def test_ember_keys_create_list_revoke(tmp_path: Path) -> None:
    created = run_ember("keys", "create", "--name", "laptop", home=tmp_path)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith(KEY_PREFIX) and "shown only now" in created.stderr
    store = KeyStore(tmp_path / "serve" / "keys.json")
    assert store.verify(key).name == "laptop"
    listed = run_ember("keys", "list", home=tmp_path)
    assert "laptop" in listed.stdout and key not in listed.stdout
    revoked = run_ember("keys", "revoke", "laptop", home=tmp_path)
    assert revoked.returncode == 0 and "laptop" in revoked.stdout
    assert store.verify(key) is None
    again = run_ember("keys", "revoke", "laptop", home=tmp_path)
    assert again.returncode == 1 and "no key named 'laptop'" in again.stderr and "Traceback" not in again.stderr


def test_the_gateway_and_serve_modules_do_not_import_torch() -> None:
    code = ("import sys, ember.cli.main, ember_platform.serve, ember_platform.gateway.app; "
            "ember.cli.main.build_parser(); assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
