"""Fuzz target for the package reader: `ember.lock` (the registry's package index), `ember.toml`, the files a build
walks and the paths a pull writes. The property, for any input: it loads, or it raises Ember's own error naming the
file; never another exception, and never a path written outside the destination.

Bounded for CI (EMBER_FUZZ_EXAMPLES examples per target, default 150); raise it for a longer campaign, e.g.
`EMBER_FUZZ_EXAMPLES=20000 pytest tests/fuzz/test_package_reader.py`."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.errors import EmberError, ManifestError, PackageError
from ember.manifest import load_manifest
from ember.package.build import build_package
from ember.package.lock import LOCK_NAME, Lock, LockedFile, package_digest
from ember.registry.cache import BlobCache
from ember.registry.local import LocalRegistry
from ember.registry.transfer import pull_package

EXAMPLES = int(os.environ.get("EMBER_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
DEEP = 100_000  # deeper than any recursive-descent parser's stack

# --- strategies -------------------------------------------------------------------------------------------------

# Characters a hostile file name or string may hold: anything, plus the ones that matter to paths, lines and
# encodings (lone surrogates, NUL, separators, newlines, tabs, bidi overrides, BOM).
SPECIAL = ["\ud800", "\udcff", "\x00", "\n", "\t", "\r", "/", "\\", ".", ":", "\u202e", "\ufeff", "\x7f", "é"]
hostile_char = st.one_of(st.characters(), st.sampled_from(SPECIAL))
hostile_text = st.text(hostile_char, max_size=12)
path_part = st.one_of(
    st.sampled_from(["", ".", "..", "weights", "config.json", "a", "A", LOCK_NAME, "C:", "x" * 300, "~",
                     "__pycache__", "model.bin", ".ember-tmp-x", "e\u0301"]),
    st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=8),
    hostile_text)
hostile_path = st.builds(lambda lead, parts: lead + "/".join(parts), st.sampled_from(["", "", "", "/", "//"]),
                         st.lists(path_part, min_size=1, max_size=4))
safe_path = st.lists(st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=6),
                     min_size=1, max_size=3).map("/".join)
any_path = st.one_of(safe_path, hostile_path)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), hostile_text,
                        st.integers(min_value=10**30, max_value=10**40))
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(hostile_text, inner, max_size=3), max_leaves=8)
sha = st.one_of(st.text("0123456789abcdef", min_size=64, max_size=64), st.text(max_size=70))


def deep(depth: int, opener: str) -> str:
    return opener * depth


def _oracle_digest(entries: list[dict[str, Any]]) -> str | None:
    """The digest the lock format defines, computed here independently, tolerating what the reader must refuse
    (so a hostile entry gets past the digest check and the path checks are what is exercised)."""
    try:
        rows = sorted((e["path"], e["size"], e["sha256"]) for e in entries)
    except (KeyError, TypeError):
        return None
    h = hashlib.sha256()
    for path, size, digest in rows:
        h.update(f"{path}\t{size}\t{digest}\n".encode("utf-8", "surrogatepass"))
    return "sha256:" + h.hexdigest()


@st.composite
def lock_documents(draw: st.DrawFn) -> str | bytes:
    """Raw `ember.lock` text: near-valid documents with hostile fields, mostly with a matching digest."""
    kind = draw(st.sampled_from(["doc", "doc", "doc", "doc", "bytes", "deep", "value"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "deep":
        return deep(draw(st.sampled_from([100, 3000])), draw(st.sampled_from(["[", '{"a":', '{"files":['])))
    if kind == "value":
        return json.dumps(draw(json_value))
    entries: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(0, 4))):
        entry: dict[str, Any] = {"path": draw(any_path), "size": draw(st.integers(0, 100)), "sha256": draw(sha)}
        if draw(st.integers(0, 5)) == 0:
            entry[draw(st.sampled_from(["path", "size", "sha256"]))] = draw(json_value)
        entries.append(entry)
    doc: dict[str, Any] = {"lock_version": 1, "name": draw(st.one_of(st.just("pkg"), hostile_text)),
                           "version": draw(st.one_of(st.just("1.0"), hostile_text)), "files": entries}
    doc["digest"] = _oracle_digest(entries) if draw(st.integers(0, 4)) else draw(json_value)
    if draw(st.integers(0, 6)) == 0:
        doc[draw(st.sampled_from(["lock_version", "name", "version", "files"]))] = draw(json_value)
    text = json.dumps(doc, ensure_ascii=draw(st.booleans()))
    return text.encode("utf-8", "surrogatepass") if draw(st.booleans()) else text


# --- oracles ----------------------------------------------------------------------------------------------------


def assert_safe_path(path: str) -> None:
    """What an accepted lock path must be, judged without the reader's code: canonical, relative, inside the
    package, encodable, no control characters (the digest's lines are tab- and newline-separated)."""
    path.encode("utf-8")
    assert not any(unicodedata.category(c) == "Cc" for c in path), path
    assert not path.startswith("/") and "\\" not in path and not re.match(r"[A-Za-z]:", path), path  # no drive
    assert all(part not in ("", ".", "..") for part in path.split("/")), path
    assert os.path.normpath(os.path.join("/root", path)).startswith("/root/"), path


def check_lock(raw: str | bytes, source: str) -> Lock | None:
    try:
        lock = Lock.from_json(raw, source=source)
    except PackageError as e:
        assert source in str(e)
        return None
    for entry in lock.files:
        assert_safe_path(entry.path)
    assert Lock.from_json(lock.to_json(), source=source) == lock  # what it writes, it reads back
    return lock


def tree(root: Path) -> set[str]:
    """Every path under root (links not followed), relative."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# --- targets ----------------------------------------------------------------------------------------------------


@FUZZ
@given(raw=lock_documents())
def test_any_lock_either_loads_safe_paths_or_is_refused_naming_the_file(raw: str | bytes) -> None:
    check_lock(raw, "/registry/packages/pkg/1.0.json")


@pytest.mark.parametrize("opener", ["[", '{"files":[', '{"a":'])
def test_deeply_nested_lock_is_refused_naming_the_file(opener: str) -> None:
    with pytest.raises(PackageError, match=r"ember\.lock"):
        Lock.from_json(deep(DEEP, opener), source="ember.lock")


def test_two_file_lists_never_share_a_package_digest_through_tabs_or_newlines() -> None:
    # The digest hashes "<path>\t<size>\t<sha256>\n" lines: a path holding a tab and a newline could spell two
    # files, so one list of files would pass for another. Such paths are refused.
    h1, h2 = "1" * 64, "2" * 64
    two = [{"path": "a", "size": 1, "sha256": h1}, {"path": "b", "size": 2, "sha256": h2}]
    forged = [{"path": f"a\t1\t{h1}\nb", "size": 2, "sha256": h2}]
    assert _oracle_digest(two) == _oracle_digest(forged)
    doc = {"lock_version": 1, "name": "pkg", "version": "1.0", "files": forged, "digest": _oracle_digest(forged)}
    with pytest.raises(PackageError, match="control character"):
        Lock.from_json(json.dumps(doc), source="ember.lock")


@st.composite
def pulled_packages(draw: st.DrawFn) -> tuple[list[tuple[str, bytes]], bool]:
    files = draw(st.lists(st.tuples(any_path, st.binary(max_size=16)), max_size=5))
    return files, draw(st.booleans())  # the second: a size in the lock that disagrees with the blob


@FUZZ
@given(package=pulled_packages())
def test_pull_writes_inside_the_destination_or_nothing(package: tuple[list[tuple[str, bytes]], bool]) -> None:
    files, wrong_size = package
    with tempfile.TemporaryDirectory() as tmp:
        sandbox = Path(tmp)
        # Four levels down: a path of at most four '..' parts that escaped would still land in the sandbox.
        base = sandbox / "a" / "b" / "c"
        registry_root, cache_root, parent = base / "registry", base / "cache", base / "deploy"
        parent.mkdir(parents=True)
        registry = LocalRegistry(registry_root)
        entries = []
        for path, content in files:
            digest = hashlib.sha256(content).hexdigest()
            blob = registry_root / "blobs" / "sha256" / digest
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(content)
            entries.append({"path": path, "size": len(content) + (1 if wrong_size else 0), "sha256": digest})
        doc = {"lock_version": 1, "name": "pkg", "version": "1.0", "files": entries,
               "digest": _oracle_digest(entries)}
        index = registry_root / "packages" / "pkg" / "1.0.json"
        index.parent.mkdir(parents=True, exist_ok=True)
        index.write_bytes(json.dumps(doc).encode("utf-8", "surrogatepass"))
        before = tree(sandbox)
        dest = parent / "pkg"
        try:
            result = pull_package("pkg:1.0", registry, dest, BlobCache(cache_root))
        except EmberError as e:
            assert any(str(p) in str(e) for p in (registry_root, cache_root, dest)) or LOCK_NAME in str(e), e
            assert not dest.exists()
            assert tree(parent) == set()  # no temporary directory left either
        else:
            for entry in result.lock.files:
                assert_safe_path(entry.path)
            for path in dest.rglob("*"):
                assert not path.is_symlink(), path
                assert path.resolve().is_relative_to(dest.resolve()), path
        allowed = (str(cache_root.relative_to(sandbox)), str(dest.relative_to(sandbox)))
        written = {p for p in tree(sandbox) - before if not p.startswith(allowed)}
        assert not written, written  # nothing outside the destination (and the cache)


@st.composite
def manifest_texts(draw: st.DrawFn) -> bytes:
    """`ember.toml` bytes: rendered near-valid manifests with hostile values, raw bytes, deep nesting."""
    kind = draw(st.sampled_from(["toml", "toml", "toml", "toml", "bytes", "deep"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "deep":
        return ("[quantization]\noptions = { a = " + deep(draw(st.sampled_from([100, 3000])), "[")).encode()
    values = {
        "model": {"name": st.one_of(st.just("pkg"), hostile_text), "version": st.one_of(st.just("1.0"), hostile_text),
                  "weights": st.one_of(st.just("weights"), any_path)},
        "runtime": {"max_num_seqs": st.integers(-2, 10**20), "kv_block_size": st.integers(-2, 10**20),
                    "memory_utilization": st.floats(), "dtype": hostile_text},
        "speculator": {"method": hostile_text, "num_speculative_tokens": st.integers(), "model": any_path},
        "scaling": {"scale_down_delay": st.one_of(st.floats(), hostile_text,
                                                  st.sampled_from(["5m", "1e9h", "9" * 400])),
                    "min_replicas": st.integers(-1, 3)},
        "serving": {"request_timeout": st.one_of(st.floats(), st.sampled_from(["10m", "nan", "inf"])),
                    "max_queue": st.integers()},
        "lora": {"name": hostile_text, "path": any_path},
        "bogus": {"key": st.integers()},
    }
    lines: list[str] = []
    for section, fields in values.items():
        if section != "model" and draw(st.integers(0, 2)) == 0:
            continue
        lines.append("[[lora]]" if section == "lora" else f"[{section}]")
        for key, strategy in fields.items():
            if draw(st.integers(0, 3)):
                lines.append(f"{key} = {toml_value(draw(strategy))}")
    text = "\n".join(lines) + "\n"
    return text.encode("utf-8", "surrogatepass")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value == math.inf else "-inf" if value == -math.inf
                                                 else repr(value))
    if isinstance(value, int):
        return str(value)
    return json.dumps(value, ensure_ascii=False)  # a TOML basic string (JSON's escapes are TOML's)


@FUZZ
@given(text=manifest_texts())
def test_any_manifest_either_loads_inside_the_package_or_is_refused_naming_the_file(text: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pkg"
        (root / "weights").mkdir(parents=True)
        (root / "ember.toml").write_bytes(text)
        try:
            manifest = load_manifest(root)
        except ManifestError as e:
            assert str(root / "ember.toml") in str(e)
            return
        for relative in [manifest.model.weights, manifest.speculator.model,
                         *(entry.path for entry in manifest.lora)]:
            if relative is not None:
                assert (root / relative).resolve().is_relative_to(root.resolve()), relative
        assert math.isfinite(manifest.scaling.scale_down_delay)
        assert math.isfinite(manifest.serving.request_timeout)


@pytest.mark.parametrize("field", ["scaling.scale_down_delay", "serving.request_timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", '"' + "9" * 400 + 'h"'])
def test_a_duration_that_is_not_a_finite_number_of_seconds_is_refused(tmp_path: Path, field: str,
                                                                      value: str) -> None:
    section, key = field.split(".")
    (tmp_path / "weights").mkdir()
    (tmp_path / "ember.toml").write_text(f'[model]\nname = "pkg"\nversion = "1.0"\n[{section}]\n{key} = {value}\n')
    with pytest.raises(ManifestError, match=rf"ember\.toml: {field}: .*finite"):
        load_manifest(tmp_path)


def test_deeply_nested_manifest_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "ember.toml").write_text("[quantization]\noptions = { a = " + deep(DEEP, "["))
    with pytest.raises(ManifestError, match=r"ember\.toml"):
        load_manifest(tmp_path)


# Names a package's files may have on disk: bytes, since a file name need not be UTF-8 at all.
file_name = st.one_of(st.binary(min_size=1, max_size=10).filter(lambda b: b"/" not in b and b"\x00" not in b
                                                                and b not in (b".", b"..")),
                      st.sampled_from([b"a\nb", b"a\tb", b"\xff", b"x.bin", b"\xed\xa0\x80", b"ok.txt"]))


@st.composite
def package_trees(draw: st.DrawFn) -> list[tuple[str, bytes, bytes]]:
    """Entries (kind, name, data) to create in a package: files, subdirectory files, symlinks in and out."""
    entries = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["file", "file", "subdir", "link-out", "link-in", "link-dangling"]))
        entries.append((kind, draw(file_name), draw(st.binary(max_size=8))))
    return entries


@FUZZ
@given(entries=package_trees())
def test_build_locks_only_what_a_pull_can_read_back(entries: list[tuple[str, bytes, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        outside = Path(tmp) / "secret.txt"
        outside.write_text("secret")
        root = Path(tmp) / "pkg"
        (root / "weights").mkdir(parents=True)
        (root / "weights" / "config.json").write_text("{}")
        (root / "weights" / "model.safetensors").write_bytes(b"\0" * 8)
        (root / "ember.toml").write_text('[model]\nname = "pkg"\nversion = "1.0"\n')
        escapes = False
        for kind, name, data in entries:
            where = os.fsencode(root) + b"/" + (b"sub/" if kind == "subdir" else b"") + name
            os.makedirs(os.path.dirname(where), exist_ok=True)
            if os.path.lexists(where):
                continue
            if kind in ("file", "subdir"):
                with open(where, "wb") as out:
                    out.write(data)
            elif kind == "link-out":
                os.symlink(os.fsencode(outside), where)
                escapes = True
            elif kind == "link-in":
                os.symlink(b"ember.toml", where)
            else:
                os.symlink(b"missing-target", where)
        try:
            lock = build_package(root)
        except EmberError as e:
            assert str(root) in str(e)
            return
        assert not escapes, "a symlink out of the package was locked"
        for entry in lock.files:
            assert_safe_path(entry.path)
        assert Lock.from_json((root / LOCK_NAME).read_bytes(), source=str(root / LOCK_NAME)) == lock


def test_a_locked_file_list_digest_is_the_documented_one() -> None:
    # The oracle above is the format's definition; it must agree with Ember's on ordinary paths.
    files = (LockedFile("a/b", 3, "1" * 64), LockedFile("c", 0, "2" * 64))
    entries = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in files]
    assert package_digest(files) == _oracle_digest(entries)
