"""Two pulls of one blob at once (`ember serve` deploying two packages that share their weights): the second to finish
keeps the first's cached file instead of replacing it, since replacing a file another pull is hardlinking makes
link(2) fail with ENOENT ("cannot lay out 'weights/model.safetensors'", seen in CI)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from ember.registry import BlobCache, LocalRegistry


def _registry_with_blob(root: Path, data: bytes) -> tuple[LocalRegistry, str]:
    registry = LocalRegistry(root / "registry")
    digest = hashlib.sha256(data).hexdigest()
    source = root / "blob"
    source.write_bytes(data)
    registry.put_blob(digest, source)
    return registry, digest


def test_a_blob_placed_by_another_pull_meanwhile_is_kept_not_replaced(tmp_path: Path) -> None:
    data = os.urandom(4096)
    registry, digest = _registry_with_blob(tmp_path, data)
    cache = BlobCache(tmp_path / "cache")
    get_blob = registry.get_blob
    placed: dict[str, int] = {}

    def concurrent_pull_lands_first(hexdigest, size, dest, on_bytes=None):
        if not placed:  # the other pull places the blob while this one downloads
            placed["inode"] = -1  # (its own download goes straight to the registry)
            placed["inode"] = BlobCache(cache.root).fetch(registry, hexdigest, size).stat().st_ino
        get_blob(hexdigest, size, dest, on_bytes)

    registry.get_blob = concurrent_pull_lands_first  # type: ignore[method-assign]
    path = cache.fetch(registry, digest, len(data))
    assert path.stat().st_ino == placed["inode"]  # the first copy's inode: a hardlink taken from it stays valid
    assert path.read_bytes() == data
    assert not list((tmp_path / "cache" / "tmp").iterdir())  # this pull's download is cleaned up


class _MissesEverything(BlobCache):
    """A cache over the same directory as a pull that found the blob missing sees it (another process, say)."""

    def lookup(self, hexdigest: str, size: int) -> None:
        return None


def test_hardlinking_from_the_cache_never_fails_while_others_fetch_the_same_blob(tmp_path: Path) -> None:
    data = os.urandom(1 << 16)
    registry, digest = _registry_with_blob(tmp_path, data)
    final = BlobCache(tmp_path / "cache").fetch(registry, digest, len(data))
    others = _MissesEverything(tmp_path / "cache")
    stop = threading.Event()

    def fetch_again() -> None:
        while not stop.is_set():
            others.fetch(registry, digest, len(data))

    threads = [threading.Thread(target=fetch_again) for _ in range(2)]
    for t in threads:
        t.start()
    failures = 0
    try:
        for i in range(3000):
            link = tmp_path / f"link{i}"
            try:
                os.link(final, link)  # what laying a package out from the cache does
                link.unlink()
            except FileNotFoundError:
                failures += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert failures == 0, f"{failures} of 3000 hardlinks failed with ENOENT"
