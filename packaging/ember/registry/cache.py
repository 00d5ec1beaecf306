"""The local blob cache: `blobs/sha256/<hex>`, each file checked against its digest before it
enters, then made read-only, so a pulled package can be hardlinked from it safely."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from ember.errors import PackageError
from ember.package.lock import hash_file
from ember.registry.base import OnBytes, Registry, blob_key

_NO_HARDLINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EMLINK})  # filesystems (or inodes) that refuse one

DEFAULT_CACHE = "~/.ember/cache"


class BlobCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    @classmethod
    def default(cls) -> BlobCache:
        """`$EMBER_CACHE`, else ~/.ember/cache."""
        return cls(os.environ.get("EMBER_CACHE") or DEFAULT_CACHE)

    def path(self, hexdigest: str) -> Path:
        return self.root.joinpath(*blob_key(hexdigest).split("/"))

    def lookup(self, hexdigest: str, size: int) -> Path | None:
        """The cached blob, or None. A copy of the wrong size (a damaged disk, a hand edit) is dropped."""
        path = self.path(hexdigest)
        try:
            cached = path.stat().st_size
        except FileNotFoundError:
            return None
        if cached != size:
            path.unlink(missing_ok=True)
            return None
        return path

    def fetch(self, registry: Registry, hexdigest: str, size: int,
              on_bytes: OnBytes | None = None) -> Path:
        """Download a blob into the cache unless it is there already; return its cached path."""
        cached = self.lookup(hexdigest, size)
        if cached is not None:
            return cached
        final = self.path(hexdigest)
        where = registry.where(blob_key(hexdigest))
        # Downloads land in tmp/ on the same filesystem, so entering the cache is one atomic rename
        # and a blob that fails its check is deleted without ever having been in blobs/.
        tmp_dir = self.root / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = tmp_dir / f"{hexdigest}.{uuid.uuid4().hex}.part"
        try:
            registry.get_blob(hexdigest, size, tmp, on_bytes)
            got_size, got_digest = hash_file(tmp)
            if got_size != size:
                raise PackageError(f"{where}: downloaded {got_size} bytes but the lock says {size}; "
                                   "refusing the blob")
            if got_digest != hexdigest:
                raise PackageError(f"{where}: content hashes to sha256:{got_digest[:12]}…, not its name; "
                                   "the registry copy was tampered with or damaged, refusing it")
            os.chmod(tmp, 0o444)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                # link, not replace: a blob another pull placed meanwhile stays. Replacing it would drop that inode's
                # last name while the other pull hardlinks it into its package, and link(2) then fails with ENOENT
                # (seen as "cannot lay out 'weights/model.safetensors'" when `ember serve` deployed two packages
                # sharing their weights at once).
                os.link(tmp, final)
            except FileExistsError:
                pass  # the same content, verified by whoever placed it
            except OSError as e:
                if e.errno not in _NO_HARDLINKS:
                    raise
                os.replace(tmp, final)  # a filesystem without hardlinks: the old behaviour
        finally:
            tmp.unlink(missing_ok=True)
        return final

    def evict_damaged(self, blobs: dict[str, int]) -> list[str]:
        """Re-hash the cached copies of `blobs`; delete those whose content no longer matches their
        name (a pulled package's hardlinked file edited in place). Returns the deleted digests."""
        damaged = []
        for hexdigest in blobs:
            path = self.path(hexdigest)
            if path.is_file() and hash_file(path)[1] != hexdigest:
                path.unlink()
                damaged.append(hexdigest)
        return damaged
