"""`ember.lock`: every file of a package with its size and sha256, and the package digest.

The lock is also the registry's package index, so reading one is a trust boundary: a lock
that names an absolute path, a `..` component, a duplicate path or a malformed digest is
refused before anything is written.

Format (JSON, sorted keys, two-space indent, trailing newline — byte-for-byte reproducible):

    {"digest": "sha256:<hex>", "files": [{"path": ..., "sha256": ..., "size": ...}, ...],
     "lock_version": 1, "name": ..., "version": ...}

The digest is sha256 over the lines "<path>\\t<size>\\t<sha256>\\n" of the files in path order,
so it identifies content alone, whatever the order files were found in.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ember.errors import PackageError

LOCK_NAME = "ember.lock"
LOCK_VERSION = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, order=True)
class LockedFile:
    """One file of a package: its path relative to the package root (POSIX form)."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Lock:
    name: str
    version: str
    files: tuple[LockedFile, ...]

    @property
    def digest(self) -> str:
        return package_digest(self.files)

    @property
    def reference(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def blobs(self) -> dict[str, int]:
        """Distinct blob digests and their sizes (two identical files are one blob)."""
        return {f.sha256: f.size for f in self.files}

    def to_json(self) -> bytes:
        doc = {
            "lock_version": LOCK_VERSION,
            "name": self.name,
            "version": self.version,
            "digest": self.digest,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
        }
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes | str, *, source: str = LOCK_NAME) -> Lock:
        """Parse and check a lock; every problem is a PackageError naming `source`."""
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise PackageError(f"{source}: not valid JSON ({e})") from None
        except RecursionError:  # the parser recurses per level: a hostile index can be nested past the stack
            raise PackageError(f"{source}: not a lock: JSON nested too deeply") from None
        if not isinstance(doc, dict):
            raise PackageError(f"{source}: expected a JSON object")
        if doc.get("lock_version") != LOCK_VERSION:
            raise PackageError(f"{source}: unsupported lock_version {doc.get('lock_version')!r} "
                               f"(this Ember reads version {LOCK_VERSION})")
        name, version, files = doc.get("name"), doc.get("version"), doc.get("files")
        if not isinstance(name, str) or not isinstance(version, str) or not isinstance(files, list):
            raise PackageError(f"{source}: needs string 'name' and 'version' and a list 'files'")
        entries = tuple(sorted(_parse_entry(item, source) for item in files))
        seen: set[str] = set()
        for entry in entries:
            key = entry.path.casefold()
            if key in seen:
                raise PackageError(f"{source}: path {entry.path!r} is listed twice")
            seen.add(key)
        lock = cls(name, version, entries)
        if doc.get("digest") != lock.digest:
            raise PackageError(f"{source}: package digest {doc.get('digest')!r} does not match its file "
                               f"list ({lock.digest}); the lock was edited or corrupted")
        return lock


def _parse_entry(item: Any, source: str) -> LockedFile:
    if not isinstance(item, dict):
        raise PackageError(f"{source}: each file entry must be an object")
    path, size, digest = item.get("path"), item.get("size"), item.get("sha256")
    if not isinstance(path, str):
        raise PackageError(f"{source}: a file entry has no string 'path'")
    check_safe_path(path, source)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise PackageError(f"{source}: {path}: size must be a non-negative integer")
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise PackageError(f"{source}: {path}: sha256 must be 64 lowercase hex digits")
    return LockedFile(path, size, digest)


def check_safe_path(path: str, source: str = LOCK_NAME) -> None:
    """Refuse a path that could write outside the package or that is not in canonical form."""
    if not path or "\x00" in path or "\\" in path:
        raise PackageError(f"{source}: unsafe path {path!r}: empty, NUL or backslash")
    # The package digest hashes tab- and newline-separated lines, so a path holding them could spell other files
    # (one file list passing for another); and a path must be UTF-8 (a lone surrogate names no file anywhere).
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in path):
        raise PackageError(f"{source}: unsafe path {path!r}: control characters and lone surrogates are not "
                           "allowed in file names")
    pure = PurePosixPath(path)
    if pure.is_absolute() or path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise PackageError(f"{source}: unsafe path {path!r}: absolute paths are not allowed")
    if any(part in ("..", ".", "") for part in path.split("/")):
        raise PackageError(f"{source}: unsafe path {path!r}: '..' or '.' components are not allowed")
    if path.split("/", 1)[0] == LOCK_NAME:  # also not as a directory: the lock is written there last
        raise PackageError(f"{source}: the lock must not list itself")


def package_digest(files: tuple[LockedFile, ...] | list[LockedFile]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f"{f.path}\t{f.size}\t{f.sha256}\n".encode())
    return "sha256:" + h.hexdigest()


def hash_file(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()
