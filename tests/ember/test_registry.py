"""Push and pull through both registry backends: round trips, deduplication, immutability, and
refusal of everything a damaged or malicious registry could serve."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ember.errors import PackageError, RegistryError
from ember.package import LOCK_NAME, Lock, LockedFile, build_package, hash_file, verify_package
from ember.package.lock import package_digest
from ember.registry import (
    BlobCache,
    LocalRegistry,
    blob_key,
    index_key,
    list_packages,
    parse_reference,
    pull_package,
    push_package,
    sort_versions,
)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def blob_keys(lock: Lock) -> set[str]:
    return {blob_key(h) for h in lock.blobs()}


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    """Parent of pull destinations: must hold nothing but what a pull leaves."""
    parent = tmp_path / "deploy"
    parent.mkdir()
    return parent


@pytest.fixture
def cache(tmp_path: Path) -> BlobCache:
    return BlobCache(tmp_path / "cache")


def assert_nothing_left(deploy: Path, cache: BlobCache, bad_blob: str | None = None) -> None:
    assert list(deploy.iterdir()) == []  # neither the destination nor a temporary directory
    assert not any((cache.root / "tmp").glob("*"))
    if bad_blob is not None:
        assert not cache.path(bad_blob).exists()


def test_push_then_pull_round_trips(store, make_package, deploy, cache):
    src = make_package(extra_toml="", seed=1)
    (src / "hooks.py").write_text("# model hooks\n")
    pushed = push_package(src, store.registry)
    lock = pushed.lock
    assert not pushed.already_pushed
    assert set(pushed.uploaded) == set(lock.blobs()) and pushed.already_present == 0
    assert set(store.list_keys()) == blob_keys(lock) | {index_key("tiny", "0.1.0")}
    assert store.read(index_key("tiny", "0.1.0")) == (src / LOCK_NAME).read_bytes()

    pulled = pull_package("tiny:0.1.0", store.registry, deploy / "out", cache)
    assert pulled.lock == lock and set(pulled.downloaded) == set(lock.blobs())
    assert verify_package(deploy / "out") == lock
    assert tree(deploy / "out") == tree(src)
    assert [p.name for p in deploy.iterdir()] == ["out"]


def test_pulled_files_are_hardlinks_of_read_only_cache_blobs(make_package, tmp_path, deploy, cache):
    src = make_package()
    registry = LocalRegistry(tmp_path / "registry")
    lock = push_package(src, registry).lock
    pull_package("tiny", registry, deploy / "out", cache)
    entry = next(f for f in lock.files if f.path.endswith(".safetensors"))
    cached = cache.path(entry.sha256)
    assert os.stat(cached).st_mode & 0o222 == 0
    assert os.stat(cached).st_ino == os.stat(deploy / "out" / entry.path).st_ino


SHM = Path("/dev/shm")


@pytest.mark.skipif(not SHM.is_dir() or not os.access(SHM, os.W_OK), reason="needs a second filesystem")
def test_pull_copies_when_the_cache_is_on_another_filesystem(make_package, tmp_path, deploy):
    cache_root = Path(tempfile.mkdtemp(prefix="ember-test-cache-", dir=SHM))
    try:
        if os.stat(cache_root).st_dev == os.stat(deploy).st_dev:
            pytest.skip("/dev/shm is on the same filesystem as the test directory")
        registry = LocalRegistry(tmp_path / "registry")
        lock = push_package(make_package(), registry).lock
        pull_package("tiny", registry, deploy / "out", BlobCache(cache_root))
        assert verify_package(deploy / "out") == lock
    finally:
        shutil.rmtree(cache_root)


def test_second_pull_comes_from_the_cache(store, make_package, deploy, cache):
    lock = push_package(make_package(), store.registry).lock
    pull_package("tiny:0.1.0", store.registry, deploy / "a", cache)
    for key in blob_keys(lock):
        store.delete(key)  # so a download would fail
    again = pull_package("tiny:0.1.0", store.registry, deploy / "b", cache)
    assert again.downloaded == {} and again.from_cache == len(lock.blobs())
    assert tree(deploy / "b") == tree(deploy / "a")


def test_new_version_changing_hooks_uploads_only_hooks_and_manifest(store, make_package):
    src = make_package()
    (src / "hooks.py").write_text("A = 1\n")
    first = push_package(src, store.registry).lock
    (src / "hooks.py").write_text("A = 2\n")
    (src / "ember.toml").write_text((src / "ember.toml").read_text().replace("0.1.0", "0.2.0"))
    result = push_package(src, store.registry)

    changed = {f.sha256 for f in result.lock.files if f.path in ("hooks.py", "ember.toml")}
    # The version lives in ember.toml, so a new version always brings a new manifest blob too.
    assert set(result.uploaded) == changed and len(result.uploaded) == 2
    assert result.already_present == len(first.blobs()) - 2
    assert set(store.list_keys()) == (blob_keys(first) | blob_keys(result.lock)
                                 | {index_key("tiny", "0.1.0"), index_key("tiny", "0.2.0")})


def test_second_version_changing_only_hooks_uploads_one_blob_and_the_lock(store, make_package):
    src = make_package()
    (src / "hooks.py").write_text("A = 1\n")
    first = push_package(src, store.registry).lock
    (src / "hooks.py").write_text("A = 2\n")
    result = push_package(src, store.registry, version="0.2.0")
    hooks = next(f for f in result.lock.files if f.path == "hooks.py")
    assert result.lock.reference == "tiny:0.2.0"
    assert result.uploaded == {hooks.sha256: hooks.size}
    assert set(store.list_keys()) == (blob_keys(first) | {f"blobs/sha256/{hooks.sha256}"}
                                      | {index_key("tiny", "0.1.0"), index_key("tiny", "0.2.0")})
    with pytest.raises(RegistryError, match=r"--version: .*not a valid version"):
        push_package(src, store.registry, version="bad version!")


def test_forced_push_changing_only_hooks_uploads_exactly_one_blob(store, make_package):
    src = make_package()
    (src / "hooks.py").write_text("A = 1\n")
    first = push_package(src, store.registry).lock
    (src / "hooks.py").write_text("A = 2  # fixed\n")
    result = push_package(src, store.registry, force=True)
    hooks = next(f for f in result.lock.files if f.path == "hooks.py")
    assert result.uploaded == {hooks.sha256: hooks.size}
    assert result.already_present == len(first.blobs()) - 1
    assert sum(k.startswith("blobs/") for k in store.list_keys()) == len(first.blobs()) + 1


def test_versions_are_immutable(store, make_package):
    src = make_package()
    push_package(src, store.registry)
    again = push_package(src, store.registry)
    assert again.already_pushed and again.uploaded == {}

    (src / "hooks.py").write_text("changed = True\n")
    before = store.list_keys()
    with pytest.raises(RegistryError, match=r"bump \[model\] version in .*ember.toml, or --force"):
        push_package(src, store.registry)
    assert store.list_keys() == before


def test_pushing_a_package_with_an_escaping_symlink_uploads_nothing(store, make_package, tmp_path):
    src = make_package()
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the registry")
    (src / "weights" / "tokenizer.json").symlink_to(secret)
    with pytest.raises(PackageError, match="symlink points outside the package"):
        push_package(src, store.registry)
    assert store.list_keys() == []


def test_pull_picks_the_latest_version_in_version_order(store, make_package, deploy, cache):
    for version in ("0.2.0", "0.10.0", "0.9.1"):
        push_package(make_package(version=version), store.registry)
    assert pull_package("tiny", store.registry, deploy / "out", cache).lock.version == "0.10.0"


def test_sort_versions_uses_pep440_then_text():
    assert sort_versions(["1.10", "1.9", "nightly", "1.0rc1", "1.0", "beta"]) == \
        ["beta", "nightly", "1.0rc1", "1.0", "1.9", "1.10"]


@pytest.mark.parametrize("bad", ["../etc", "tiny:../0.1", "a/b", "", ".hidden", "tiny:"])
def test_references_that_could_leave_the_registry_layout_are_refused(bad):
    with pytest.raises(RegistryError, match="not a package reference"):
        parse_reference(bad)


def test_missing_version_lists_the_available_ones(store, make_package, deploy, cache):
    push_package(make_package(version="0.1.0"), store.registry)
    push_package(make_package(version="0.2.0"), store.registry)
    with pytest.raises(RegistryError, match=r"tiny has no version '9.9' \(available: 0.1.0, 0.2.0\)"):
        pull_package("tiny:9.9", store.registry, deploy / "out", cache)
    with pytest.raises(RegistryError, match=r"no package named 'huge' \(available: tiny\)"):
        pull_package("huge", store.registry, deploy / "out", cache)
    assert_nothing_left(deploy, cache)


def test_pull_from_an_empty_registry_says_so(store, deploy, cache):
    with pytest.raises(RegistryError, match="the registry is empty"):
        pull_package("tiny", store.registry, deploy / "out", cache)


def test_tampered_blob_is_refused_and_never_cached(store, make_package, deploy, cache):
    lock = push_package(make_package(), store.registry).lock
    weights = next(f for f in lock.files if f.path.endswith(".safetensors"))
    good = store.read(blob_key(weights.sha256))
    store.write(blob_key(weights.sha256), bytes(b ^ 0xFF for b in good[:16]) + good[16:])
    with pytest.raises(PackageError, match="tampered with or damaged"):
        pull_package("tiny:0.1.0", store.registry, deploy / "out", cache)
    assert_nothing_left(deploy, cache, bad_blob=weights.sha256)


def test_truncated_blob_is_refused(store, make_package, deploy, cache):
    lock = push_package(make_package(), store.registry).lock
    weights = next(f for f in lock.files if f.path.endswith(".safetensors"))
    store.write(blob_key(weights.sha256), store.read(blob_key(weights.sha256))[:-100])
    with pytest.raises(PackageError, match=f"blob has {weights.size - 100} bytes but the lock says"):
        pull_package("tiny:0.1.0", store.registry, deploy / "out", cache)
    assert_nothing_left(deploy, cache, bad_blob=weights.sha256)


def test_missing_blob_is_reported(store, make_package, deploy, cache):
    lock = push_package(make_package(), store.registry).lock
    store.delete(blob_key(lock.files[0].sha256))
    with pytest.raises(RegistryError, match="blob is missing from the registry"):
        pull_package("tiny:0.1.0", store.registry, deploy / "out", cache)
    assert_nothing_left(deploy, cache)


def _forge_index(store, lock: Lock, files: list[LockedFile]) -> None:
    """An index a malicious registry could serve: well-formed JSON with a matching digest."""
    doc = json.loads(lock.to_json())
    doc["files"] = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in files]
    doc["digest"] = package_digest(files)
    store.write(index_key(lock.name, lock.version), json.dumps(doc).encode())


@pytest.mark.parametrize(("path", "message"), [
    ("../escape.py", r"'\.\.' or '\.' components"),
    ("weights/../../escape.py", r"'\.\.' or '\.' components"),
    ("/etc/cron.d/evil", "absolute paths are not allowed"),
    ("hooks.py", "is listed twice"),
    ("HOOKS.PY", "is listed twice"),
])
def test_unsafe_index_is_refused_with_nothing_left(store, make_package, deploy, cache, path, message):
    src = make_package()
    (src / "hooks.py").write_text("x = 1\n")
    lock = push_package(src, store.registry).lock
    hooks = next(f for f in lock.files if f.path == "hooks.py")
    _forge_index(store, lock, [*lock.files, LockedFile(path, hooks.size, hooks.sha256)])
    with pytest.raises(PackageError, match=message):
        pull_package("tiny:0.1.0", store.registry, deploy / "out", cache)
    assert_nothing_left(deploy, cache)
    assert not (deploy.parent / "escape.py").exists()


def test_index_whose_sizes_disagree_with_the_blobs_is_refused(store, make_package, deploy, cache):
    lock = push_package(make_package(), store.registry).lock
    files = [LockedFile(f.path, f.size + 1, f.sha256) if f.path == "ember.toml" else f for f in lock.files]
    _forge_index(store, lock, files)
    with pytest.raises(PackageError, match="but the lock says"):
        pull_package("tiny:0.1.0", store.registry, deploy / "out", cache)
    assert_nothing_left(deploy, cache)


def test_index_naming_another_package_is_refused(store, make_package, deploy, cache):
    lock = push_package(make_package(), store.registry).lock
    store.write(index_key("tiny", "9.0.0"), lock.to_json())
    with pytest.raises(PackageError, match=r"describes tiny:0\.1\.0, not tiny:9\.0\.0"):
        pull_package("tiny:9.0.0", store.registry, deploy / "out", cache)
    assert_nothing_left(deploy, cache)


def test_cached_blob_modified_through_a_hardlink_is_evicted(make_package, tmp_path, deploy, cache):
    registry = LocalRegistry(tmp_path / "registry")
    lock = push_package(make_package(), registry).lock
    pull_package("tiny", registry, deploy / "a", cache)
    config = deploy / "a" / "weights" / "config.json"
    config.chmod(0o644)
    config.write_text(config.read_text().replace("llama", "LLAMA"))  # same size, other bytes
    with pytest.raises(PackageError, match=r"had been modified .* pull again"):
        pull_package("tiny", registry, deploy / "b", cache)
    assert not (deploy / "b").exists()
    pull_package("tiny", registry, deploy / "b", cache)
    assert verify_package(deploy / "b") == lock


def test_pull_refuses_a_non_empty_destination_and_accepts_an_empty_one(store, make_package, deploy, cache):
    push_package(make_package(), store.registry)
    (deploy / "full").mkdir()
    (deploy / "full" / "keep.txt").write_text("mine")
    with pytest.raises(PackageError, match="exists and is not empty"):
        pull_package("tiny", store.registry, deploy / "full", cache)
    assert tree(deploy / "full") == {"keep.txt": b"mine"}
    (deploy / "file").write_text("x")
    with pytest.raises(PackageError, match="is not a directory"):
        pull_package("tiny", store.registry, deploy / "file", cache)

    (deploy / "empty").mkdir()
    pull_package("tiny", store.registry, deploy / "empty", cache)
    verify_package(deploy / "empty")
    assert sorted(p.name for p in deploy.iterdir()) == ["empty", "file", "full"]


def test_push_rebuilds_the_lock(store, make_package):
    src = make_package()
    (src / "hooks.py").write_text("x = 1\n")
    build_package(src)
    (src / "hooks.py").write_text("x = 2\n")  # the old lock is stale now
    lock = push_package(src, store.registry).lock
    assert next(f for f in lock.files if f.path == "hooks.py").sha256 == hash_file(src / "hooks.py")[1]


def test_list_packages_shows_every_version_with_its_digest(store, make_package):
    assert list_packages(store.registry) == []
    locks = [push_package(make_package(name=n, version=v), store.registry).lock
             for n, v in (("tiny", "0.2.0"), ("tiny", "0.1.0"), ("other", "1.0"))]
    listed = list_packages(store.registry)
    assert [(i.name, i.version) for i in listed] == [("other", "1.0"), ("tiny", "0.1.0"), ("tiny", "0.2.0")]
    by_ref = {lock.reference: lock for lock in locks}
    assert all(info.lock == by_ref[f"{info.name}:{info.version}"] for info in listed)
