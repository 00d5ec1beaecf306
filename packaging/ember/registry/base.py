"""The Registry interface: blobs stored once by digest, and each package's lock as its index.

Layout, the same in every backend (keys are relative to the registry's root or prefix):

    blobs/sha256/<hex>               file contents, stored once whatever package they belong to
    packages/<name>/<version>.json   the package's lock (see `ember.package.lock`)

A writer uploads every blob before the index, so a reader never finds an index whose blobs
are missing.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

# Called with the number of bytes just moved; may be called from several threads at once.
OnBytes = Callable[[int], None]

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def blob_key(hexdigest: str) -> str:
    # A digest comes from a parsed lock, but check again: it becomes part of a path or key.
    if not _HEX64.match(hexdigest):
        raise ValueError(f"not a sha256 hex digest: {hexdigest!r}")
    return f"blobs/sha256/{hexdigest}"


def index_key(name: str, version: str) -> str:
    return f"packages/{name}/{version}.json"


def short_digest(digest: str) -> str:
    """`sha256:` and the first 12 hex digits: enough to tell packages apart in messages."""
    return "sha256:" + digest.removeprefix("sha256:")[:12]


class Registry(ABC):
    """Where packages are pushed to and pulled from. Implementations must be thread-safe."""

    url: str
    # How many blobs to move at once; a transfer of one blob may use its own threads too.
    parallelism: int = 4

    def where(self, key: str) -> str:
        """A key spelt out in full, for messages."""
        return f"{self.url.rstrip('/')}/{key}"

    @abstractmethod
    def blob_size(self, hexdigest: str) -> int | None:
        """Size of a stored blob, or None when the registry does not have it."""

    @abstractmethod
    def put_blob(self, hexdigest: str, source: Path, on_bytes: OnBytes | None = None) -> None:
        """Store the file `source` as blob `hexdigest` (replacing a damaged copy, if any)."""

    @abstractmethod
    def get_blob(self, hexdigest: str, size: int, dest: Path, on_bytes: OnBytes | None = None) -> None:
        """Write blob `hexdigest` to the new file `dest`.

        Raises RegistryError when the blob is missing and PackageError when its stored size is not
        `size`, before downloading it. The caller still checks the content's digest.
        """

    @abstractmethod
    def read_index(self, name: str, version: str) -> bytes | None:
        """The raw lock of name:version, or None when that version was never pushed."""

    @abstractmethod
    def write_index(self, name: str, version: str, data: bytes) -> None:
        """Publish name:version (after all its blobs are stored)."""

    @abstractmethod
    def list_names(self) -> list[str]:
        """Names of the packages in the registry, sorted."""

    @abstractmethod
    def list_versions(self, name: str) -> list[str]:
        """Versions of package `name` in no particular order (empty when it has none)."""
