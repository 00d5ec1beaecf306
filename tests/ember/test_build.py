"""`ember build` and `ember verify`: deterministic locks, refused pickles and escaping links."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ember.errors import PackageError
from ember.package import LOCK_NAME, Lock, build_package, verify_package


def test_lock_lists_every_file_with_size_and_sha256(make_package) -> None:
    pkg = make_package()
    lock = build_package(pkg)
    doc = json.loads((pkg / LOCK_NAME).read_text())
    assert [f["path"] for f in doc["files"]] == ["ember.toml", "weights/config.json", "weights/model.safetensors"]
    assert doc["digest"] == lock.digest and doc["name"] == "tiny" and doc["version"] == "0.1.0"
    assert all(len(f["sha256"]) == 64 and f["size"] == (pkg / f["path"]).stat().st_size for f in doc["files"])


def test_building_twice_gives_the_same_bytes(make_package) -> None:
    a, b = make_package(subdir="a"), make_package(subdir="b")
    build_package(a)
    first = (a / LOCK_NAME).read_bytes()
    (a / "__pycache__").mkdir()  # caches and litter never enter the lock
    (a / "__pycache__" / "hooks.cpython-311.pyc").write_bytes(b"x")
    (a / ".DS_Store").write_bytes(b"x")
    build_package(a)
    assert (a / LOCK_NAME).read_bytes() == first
    # Same content elsewhere (other absolute path, other mtimes): same lock, same digest.
    os.utime(b / "ember.toml", (0, 0))
    build_package(b)
    assert (b / LOCK_NAME).read_bytes() == first


def test_digest_changes_with_content(make_package) -> None:
    pkg = make_package()
    before = build_package(pkg).digest
    (pkg / "hooks.py").write_text("# a change\n")
    assert build_package(pkg).digest != before


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.pth", "last.ckpt"])
def test_pickle_weights_are_refused(make_package, name: str) -> None:
    pkg = make_package()
    (pkg / "weights" / name).write_bytes(b"\x80\x04pickle")
    with pytest.raises(PackageError) as info:
        build_package(pkg)
    message = str(info.value)
    assert f"weights/{name}" in message and "pickle checkpoint" in message
    assert "save_pretrained" in message and "safe_serialization=True" in message  # says how to convert
    assert not (pkg / LOCK_NAME).exists()


def test_weights_without_safetensors_are_refused(make_package) -> None:
    pkg = make_package()
    (pkg / "weights" / "model.safetensors").unlink()
    with pytest.raises(PackageError, match=r"model\.weights: .* has no \*\.safetensors file"):
        build_package(pkg)


def test_symlink_leaving_the_package_is_refused(make_package, tmp_path: Path) -> None:
    pkg = make_package()
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    (pkg / "weights" / "extra.txt").symlink_to(secret)
    with pytest.raises(PackageError, match=r"extra\.txt: symlink points outside the package"):
        build_package(pkg)
    assert not (pkg / LOCK_NAME).exists()


def test_symlink_inside_the_package_is_followed(make_package) -> None:
    pkg = make_package()
    (pkg / "README.md").write_text("hello")
    (pkg / "weights" / "README.md").symlink_to(pkg / "README.md")
    lock = build_package(pkg)
    assert {"README.md", "weights/README.md"} <= {f.path for f in lock.files}
    verify_package(pkg)


def test_verify_accepts_an_untouched_package(make_package) -> None:
    pkg = make_package()
    built = build_package(pkg)
    assert verify_package(pkg).digest == built.digest


def test_verify_detects_a_tampered_file(make_package) -> None:
    pkg = make_package()
    build_package(pkg)
    path = pkg / "weights" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(PackageError, match=r"model\.safetensors: sha256 .* differs from the lock"):
        verify_package(pkg)


def test_verify_detects_truncation_and_additions(make_package) -> None:
    pkg = make_package()
    build_package(pkg)
    (pkg / "notes.txt").write_text("new")
    with pytest.raises(PackageError, match=r"files not in ember\.lock: notes\.txt"):
        verify_package(pkg)
    (pkg / "notes.txt").unlink()
    path = pkg / "weights" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(PackageError, match=r"size \d+ differs from the lock's"):
        verify_package(pkg)


def test_verify_refuses_a_file_replaced_by_an_escaping_symlink(make_package, tmp_path: Path) -> None:
    pkg = make_package()
    build_package(pkg)
    target = tmp_path / "elsewhere.json"
    target.write_bytes((pkg / "weights" / "config.json").read_bytes())  # same bytes, but outside
    (pkg / "weights" / "config.json").unlink()
    (pkg / "weights" / "config.json").symlink_to(target)
    with pytest.raises(PackageError, match="symlink points outside the package"):
        verify_package(pkg)


@pytest.mark.parametrize(("path", "problem"), [
    ("/etc/passwd", "absolute paths are not allowed"),
    ("weights/../../escape", "'..' or '.' components are not allowed"),
    ("C:/windows", "absolute paths are not allowed"),
    ("a\\b", "backslash"),
])
def test_lock_with_unsafe_path_is_refused(path: str, problem: str) -> None:
    doc = {"lock_version": 1, "name": "x", "version": "1", "digest": "sha256:0",
           "files": [{"path": path, "size": 1, "sha256": "0" * 64}]}
    with pytest.raises(PackageError, match=problem):
        Lock.from_json(json.dumps(doc))


def test_lock_with_duplicate_paths_or_wrong_digest_is_refused(make_package) -> None:
    pkg = make_package()
    doc = json.loads(build_package(pkg).to_json())
    doc["files"].append(dict(doc["files"][0]))
    with pytest.raises(PackageError, match="is listed twice"):
        Lock.from_json(json.dumps(doc))
    doc["files"].pop()
    doc["files"][0]["size"] += 1
    with pytest.raises(PackageError, match="does not match its file list"):
        Lock.from_json(json.dumps(doc))
