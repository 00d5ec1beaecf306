"""A model's identity for stored KV blocks: a digest of its weights (and of whatever else changes its KV for
the same tokens, the quantization), so that blocks are shared by exactly the replicas that would compute them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ember.errors import PackageError
from ember.package.lock import LOCK_NAME, Lock

_CHUNK = 1 << 20


def model_identity(weights_dir: Path, package_root: Path | None = None, *, quantization: str = "none",
                   quantization_options: Mapping[str, Any] | None = None) -> str:
    """`<weights digest>/<quantization>`: hex, short enough for a header and stable across hosts.

    The weights digest comes from the package's `ember.lock` when one is there and no weight file is newer
    than it (reading the digests costs nothing); otherwise the weight files are hashed here, about a second
    per GB, once at start-up and only when KV tiers are on.
    """
    weights_dir = weights_dir.resolve()
    digest = _locked_digest(weights_dir, package_root) if package_root is not None else None
    if digest is None:
        digest = _hash_files(weights_dir)
    quant = json.dumps([quantization, dict(quantization_options or {})], sort_keys=True, default=str)
    return hashlib.blake2b(f"{digest}\n{quant}".encode(), digest_size=16).hexdigest()


def _weight_files(weights_dir: Path) -> list[Path]:
    return sorted(p for p in weights_dir.rglob("*") if p.is_file() and not p.name.startswith("."))


def _locked_digest(weights_dir: Path, package_root: Path) -> str | None:
    lock_path = package_root / LOCK_NAME
    try:
        lock = Lock.from_json(lock_path.read_bytes(), source=str(lock_path))
        lock_mtime = lock_path.stat().st_mtime
    except (OSError, PackageError):
        return None
    root = package_root.resolve()
    entries = {f.path: f for f in lock.files}
    lines = []
    for path in _weight_files(weights_dir):
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else None
        entry = entries.get(rel) if rel else None
        stat = path.stat()
        # A weight file changed after `ember build`: the lock no longer describes it.
        if entry is None or entry.size != stat.st_size or stat.st_mtime > lock_mtime:
            return None
        lines.append(f"{entry.path}\t{entry.size}\t{entry.sha256}\n")
    return "lock:" + hashlib.sha256("".join(lines).encode()).hexdigest()


def _hash_files(weights_dir: Path) -> str:
    digest = hashlib.blake2b(digest_size=32)
    for path in _weight_files(weights_dir):
        digest.update(f"{path.relative_to(weights_dir).as_posix()}\t{path.stat().st_size}\n".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return "files:" + digest.hexdigest()
