"""A registry in a local (or mounted) directory; every write is a temp file renamed into place."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ember.errors import PackageError, RegistryError
from ember.registry.base import OnBytes, Registry, blob_key, index_key

_CHUNK = 1 << 20


class LocalRegistry(Registry):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def blob_size(self, hexdigest: str) -> int | None:
        key = blob_key(hexdigest)
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error("reading", key, e) from None

    def put_blob(self, hexdigest: str, source: Path, on_bytes: OnBytes | None = None) -> None:
        key = blob_key(hexdigest)
        try:
            # Hash while copying (it costs no extra read): a file edited since `ember build`
            # must not be stored under a digest that is no longer its own.
            with _atomic_file(self._path(key), mode=0o444) as out, open(source, "rb") as src:
                digest = _copy(src, out, on_bytes)
                if digest != hexdigest:
                    raise PackageError(f"{source}: changed while it was being pushed; run `ember push` again")
        except OSError as e:
            raise self._error("writing", key, e) from None

    def get_blob(self, hexdigest: str, size: int, dest: Path, on_bytes: OnBytes | None = None) -> None:
        key = blob_key(hexdigest)
        try:
            with open(self._path(key), "rb") as src:
                stored = os.fstat(src.fileno()).st_size
                if stored != size:
                    raise PackageError(size_mismatch(self.where(key), stored, size))
                with open(dest, "xb") as out:
                    _copy(src, out, on_bytes)
        except FileNotFoundError:
            raise RegistryError(missing_blob(self.where(key))) from None
        except OSError as e:
            raise self._error("reading", key, e) from None

    def read_index(self, name: str, version: str) -> bytes | None:
        key = index_key(name, version)
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error("reading", key, e) from None

    def write_index(self, name: str, version: str, data: bytes) -> None:
        key = index_key(name, version)
        try:
            with _atomic_file(self._path(key), mode=0o644) as out:
                out.write(data)
        except OSError as e:
            raise self._error("writing", key, e) from None

    def list_names(self) -> list[str]:
        return sorted(p.name for p in self._scan("packages") if p.is_dir() and not p.name.startswith("."))

    def list_versions(self, name: str) -> list[str]:
        return [p.name.removesuffix(".json") for p in self._scan(f"packages/{name}")
                if p.name.endswith(".json") and not p.name.startswith(".")]

    def _scan(self, key: str) -> list[Path]:
        try:
            return list(self._path(key).iterdir())
        except FileNotFoundError:
            return []  # a registry nobody has pushed to yet is simply empty
        except OSError as e:
            raise self._error("listing", key, e) from None

    def _error(self, action: str, key: str, e: OSError) -> RegistryError:
        return RegistryError(f"{self.where(key)}: {action} failed: {e.strerror or e}")


def missing_blob(where: str) -> str:
    return f"{where}: blob is missing from the registry (it is damaged; push the package again)"


def size_mismatch(where: str, stored: int, expected: int) -> str:
    return (f"{where}: blob has {stored} bytes but the lock says {expected}; the registry copy is "
            "truncated or was tampered with, refusing it")


@contextmanager
def _atomic_file(target: Path, mode: int) -> Iterator[BinaryIO]:
    """A file that appears at `target` complete or not at all (the rename is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _copy(src: BinaryIO, out: BinaryIO, on_bytes: OnBytes | None) -> str:
    """Copy in chunks; return the sha256 hex of what was copied."""
    h = hashlib.sha256()
    while chunk := src.read(_CHUNK):
        h.update(chunk)
        out.write(chunk)
        if on_bytes:
            on_bytes(len(chunk))
    return h.hexdigest()
