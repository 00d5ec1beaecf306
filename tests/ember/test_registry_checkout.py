"""`checkout`: a version in a packages directory, pulled once, and refused when the registry's digest is not the one
a replica was started for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ember.errors import RegistryError
from ember.registry import BlobCache, LocalRegistry, checkout, push_package


def test_a_version_is_pulled_once_then_reused_and_a_wrong_digest_is_refused(
        tmp_path: Path, make_package: Callable[..., Path]) -> None:
    registry = LocalRegistry(tmp_path / "registry")
    lock = push_package(make_package(), registry).lock
    cache = BlobCache(tmp_path / "cache")

    first = checkout(registry, lock.reference, tmp_path / "packages", cache, digest=lock.digest)
    assert first.path == tmp_path / "packages" / lock.name / lock.version and first.pull is not None
    assert first.lock.digest == lock.digest and (first.path / "ember.toml").is_file()
    again = checkout(registry, f"{lock.name}", tmp_path / "packages", cache)  # the latest: the same version
    assert again.pull is None and again.path == first.path

    with pytest.raises(RegistryError, match=r"is sha256:\w{12}, not the sha256:000000000000 this replica was started"):
        checkout(registry, lock.reference, tmp_path / "elsewhere", cache, digest="sha256:" + "0" * 64)
    assert not (tmp_path / "elsewhere" / lock.name).exists()
