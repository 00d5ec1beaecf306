"""`checkout`: one version of a package in a local packages directory, pulled once through the blob cache.

The control plane checks a version out to read its manifest; a replica checks out the version its ReplicaSpec names
(registry reference and digest) to serve it. On one machine both use the same directory, so the second finds the
first's copy; elsewhere the replica pulls. Either way the digest is the registry's lock, checked against the one
asked for: a version that changed in the registry is refused, never served.
"""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ember.errors import PackageError, RegistryError
from ember.package.lock import LOCK_NAME, Lock
from ember.registry.base import Registry, short_digest
from ember.registry.cache import BlobCache
from ember.registry.transfer import PullResult, pull_package, resolve


@dataclass(frozen=True, slots=True)
class Checkout:
    lock: Lock
    path: Path                 # packages_dir/NAME/VERSION
    pull: PullResult | None    # None: the directory held this digest already (nothing was pulled)
    resolve_s: float
    pull_s: float


def checkout(registry: Registry, reference: str, packages_dir: Path, cache: BlobCache, *,
             digest: str | None = None) -> Checkout:
    """NAME[:VERSION] at packages_dir/NAME/VERSION, pulled unless that directory holds the same digest already.

    `digest`: the one expected (a replica's spec); a registry whose version has another is refused (RegistryError).
    Safe against a concurrent checkout of the same version (another replica on the machine): whoever lands it
    first wins, and the other uses it when its digest matches.
    """
    start = time.monotonic()
    lock = resolve(registry, reference)
    resolved = time.monotonic()
    if digest is not None and lock.digest != digest:
        raise RegistryError(f"{registry.url}: {lock.reference} is {short_digest(lock.digest)}, not the "
                            f"{short_digest(digest)} this replica was started for; versions are immutable: "
                            "publish the change under a new version")
    dest = Path(packages_dir) / lock.name / lock.version
    if _digest_at(dest) == lock.digest:
        return Checkout(lock, dest, None, resolved - start, 0.0)
    if dest.exists():  # a damaged or stale pull: replicas of it may still run from their open files
        stale = dest.with_name(f".{dest.name}.stale-{uuid.uuid4().hex[:8]}")
        with contextlib.suppress(FileNotFoundError):  # another checkout moved it first
            dest.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        result = pull_package(lock.reference, registry, dest, cache)
    except PackageError:
        if _digest_at(dest) == lock.digest:  # a concurrent checkout landed it as this one pulled
            return Checkout(lock, dest, None, resolved - start, time.monotonic() - resolved)
        raise
    if digest is not None and result.lock.digest != digest:  # republished between the two reads: refuse it
        shutil.rmtree(dest, ignore_errors=True)
        raise RegistryError(f"{registry.url}: {lock.reference} changed while it was pulled; versions are immutable")
    return Checkout(result.lock, dest, result, resolved - start, time.monotonic() - resolved)


def _digest_at(package_dir: Path) -> str | None:
    try:
        return Lock.from_json((package_dir / LOCK_NAME).read_bytes(), source=str(package_dir / LOCK_NAME)).digest
    except (OSError, PackageError):
        return None
