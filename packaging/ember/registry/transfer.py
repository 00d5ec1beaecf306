"""Push, pull and list packages: the logic shared by every registry backend."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ember.errors import PackageError, RegistryError
from ember.package.build import build_package
from ember.package.lock import LOCK_NAME, Lock
from ember.package.verify import verify_package
from ember.registry.base import Registry, index_key, short_digest
from ember.registry.cache import BlobCache
from ember.registry.progress import TransferProgress
from ember.registry.reference import parse_reference, sort_versions

T = TypeVar("T")
R = TypeVar("R")

# A hardlink cannot cross filesystems (EXDEV) and may be refused (EPERM under
# fs.protected_hardlinks, EMLINK at the link limit, ENOTSUP on some filesystems): copy instead.
_LINK_FALLBACK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES})


@dataclass(frozen=True, slots=True)
class PushResult:
    lock: Lock
    registry_url: str
    uploaded: dict[str, int]  # blob hex digest -> size, for the blobs this push uploaded
    already_present: int      # blobs the registry had before
    already_pushed: bool      # name:version was there with the same digest: nothing was done

    @property
    def uploaded_bytes(self) -> int:
        return sum(self.uploaded.values())


@dataclass(frozen=True, slots=True)
class PullResult:
    lock: Lock
    dest: Path
    downloaded: dict[str, int]  # blob hex digest -> size, for the blobs fetched from the registry
    from_cache: int

    @property
    def downloaded_bytes(self) -> int:
        return sum(self.downloaded.values())


@dataclass(frozen=True, slots=True)
class PackageInfo:
    """One row of `ember ls`: a version whose index could be read, or the reason it could not."""

    name: str
    version: str
    lock: Lock | None
    problem: str | None = None


class VersionConflict(RegistryError):
    """A push of a version the registry holds with other content. `remedy` is how the caller's user gets past it
    (`ember push` has --force, `ember serve` has --dev)."""

    def __init__(self, reference: str, registry_url: str, had: str, built: str, manifest: Path,
                 remedy: str = "or --force") -> None:
        self.reference, self.registry_url, self.had, self.built, self.manifest = (
            reference, registry_url, had, built, manifest)
        super().__init__(f"{reference} is already in {registry_url} with different content ({had}, this build is "
                         f"{built}); versions are immutable: bump [model] version in {manifest}, {remedy}")

    def with_remedy(self, remedy: str) -> VersionConflict:
        return VersionConflict(self.reference, self.registry_url, self.had, self.built, self.manifest, remedy)


def dev_version(lock: Lock) -> str:
    """The version of a working copy served as it is: [model] version plus its content digest as a PEP 440 local
    version (`0.1.0+dev.1a2b3c4d5e6f`), so every edit is a new version and the same files are the same one."""
    return f"{lock.version}+dev.{lock.digest.removeprefix('sha256:')[:12]}"


def push_package(root: str | Path, registry: Registry, *, force: bool = False,
                 version: str | None = None, dev: bool = False) -> PushResult:
    """Build `root` (validating it and writing ember.lock), upload the blobs the registry lacks,
    then publish the index. Versions are immutable unless `force`.

    `version` publishes under another version than [model] version, like tagging an image: a
    version is registry metadata (the package digest covers files only), so releasing an edit of
    hooks.py as a new version uploads that one file and the index. `dev` publishes under the
    content-derived `dev_version`.
    """
    from pydantic import ValidationError

    from ember.manifest.schema import ModelSection
    from ember.plugins import PluginHost  # loads every installed plugin: only when pushing

    root = Path(root)
    lock = build_package(root, PluginHost.for_package(root))
    if dev:
        version = dev_version(lock)
    if version is not None and version != lock.version:
        try:
            ModelSection.model_validate({"name": lock.name, "version": version, "weights": "."})
        except ValidationError as e:
            message = e.errors()[0]["msg"].removeprefix("Value error, ")
            raise RegistryError(f"--version: {message}") from None
        lock = Lock(lock.name, version, lock.files)
    existing = registry.read_index(lock.name, lock.version)
    if existing is not None:
        try:
            old_digest: str | None = Lock.from_json(
                existing, source=registry.where(index_key(lock.name, lock.version))).digest
        except PackageError:
            old_digest = None  # a damaged index can only be replaced, and only with --force
        if old_digest == lock.digest:
            return PushResult(lock, registry.url, {}, len(lock.blobs()), already_pushed=True)
        if not force:
            had = short_digest(old_digest) if old_digest else "an unreadable index"
            raise VersionConflict(lock.reference, registry.url, had, short_digest(lock.digest), root / "ember.toml")

    blobs = lock.blobs()
    source = {f.sha256: root / f.path for f in lock.files}
    stored = _parallel(registry.blob_size, list(blobs), registry.parallelism)
    # A stored blob of the wrong size is a damaged upload: send it again.
    missing = {h: size for (h, size), have in zip(blobs.items(), stored, strict=True) if have != size}
    total = sum(missing.values())
    with TransferProgress(f"pushing {lock.reference}", total) as bar:
        _parallel(lambda h: registry.put_blob(h, source[h], bar.advance), list(missing),
                  registry.parallelism)
    # Only now, with every blob stored, does the version become visible to readers.
    registry.write_index(lock.name, lock.version, lock.to_json())
    return PushResult(lock, registry.url, missing, len(blobs) - len(missing), already_pushed=False)


def resolve(registry: Registry, reference: str) -> Lock:
    """The lock of NAME[:VERSION] (the latest version when none is given), checked for safety."""
    name, version = parse_reference(reference)
    if version is None:
        version = _latest_version(registry, name)
    raw = registry.read_index(name, version)
    if raw is None:
        versions = sort_versions(registry.list_versions(name))
        if not versions:
            raise RegistryError(f"{registry.url}: no package named {name!r}{_available_names(registry)}")
        raise RegistryError(f"{registry.url}: {name} has no version {version!r} "
                            f"(available: {', '.join(versions)})")
    where = registry.where(index_key(name, version))
    lock = Lock.from_json(raw, source=where)  # refuses unsafe or duplicate paths, a wrong digest
    if (lock.name, lock.version) != (name, version):
        raise PackageError(f"{where}: describes {lock.reference}, not {name}:{version}; the registry "
                           "was tampered with or damaged")
    return lock


def pull_package(reference: str, registry: Registry, dest: str | Path,
                 cache: BlobCache | None = None) -> PullResult:
    """Fetch NAME[:VERSION] into the new directory `dest`, through the blob cache.

    The package is assembled and verified in a temporary directory beside `dest` and renamed into
    place last: on any failure nothing is left at `dest` and the temporary directory is removed.
    """
    dest = Path(dest)
    cache = cache or BlobCache.default()
    _check_destination(dest)
    lock = resolve(registry, reference)
    blobs = lock.blobs()
    missing = {h: size for h, size in blobs.items() if cache.lookup(h, size) is None}
    with TransferProgress(f"pulling {lock.reference}", sum(missing.values())) as bar:
        _parallel(lambda h: cache.fetch(registry, h, missing[h], bar.advance), list(missing),
                  registry.parallelism)

    dest.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would become the package's; mkdir honours the umask.
    tmp = dest.parent / f".{dest.name}.ember-pull-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        _materialize(lock, cache, tmp)
        try:
            verify_package(tmp)
        except PackageError as e:
            # Blobs were checked on their way into the cache, so a mismatch now means a cached copy
            # was changed since; drop it so that pulling again downloads a good one.
            damaged = cache.evict_damaged(blobs)
            if not damaged:  # named where the file would have been: the temporary directory is gone
                raise PackageError(str(e).replace(str(tmp), str(dest))) from None
            raise PackageError(f"{cache.root}: {len(damaged)} cached blob(s) had been modified "
                               f"(sha256:{damaged[0][:12]}…) and were removed; pull again") from None
        _check_destination(dest)
        try:
            # rename(2) replaces an empty directory, and fails (rather than merging) on a full one.
            tmp.rename(dest)
        except OSError as e:
            raise PackageError(f"{dest}: cannot move the pulled package into place: {e.strerror or e}") \
                from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PullResult(lock, dest, missing, len(blobs) - len(missing))


def list_packages(registry: Registry) -> list[PackageInfo]:
    """Every version of every package, oldest first within a name."""
    pairs = [(name, version) for name in registry.list_names()
             for version in sort_versions(registry.list_versions(name))]

    def describe(pair: tuple[str, str]) -> PackageInfo:
        name, version = pair
        raw = registry.read_index(name, version)
        if raw is None:  # removed while we were listing
            return PackageInfo(name, version, None, "index vanished")
        try:
            return PackageInfo(name, version, Lock.from_json(raw, source=index_key(name, version)))
        except PackageError as e:
            return PackageInfo(name, version, None, str(e))

    return _parallel(describe, pairs, registry.parallelism)


def _latest_version(registry: Registry, name: str) -> str:
    versions = sort_versions(registry.list_versions(name))
    if not versions:
        raise RegistryError(f"{registry.url}: no package named {name!r}{_available_names(registry)}")
    return versions[-1]


def _available_names(registry: Registry) -> str:
    names = registry.list_names()
    return f" (available: {', '.join(names)})" if names else " (the registry is empty)"


def _check_destination(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise PackageError(f"{dest}: exists and is not a directory; choose another --to")
    if dest.is_dir() and any(dest.iterdir()):
        raise PackageError(f"{dest}: exists and is not empty; choose another --to or remove it")


def _materialize(lock: Lock, cache: BlobCache, root: Path) -> None:
    """Lay the package out from the cache: hardlinks (no copy, no extra disk), else copies."""
    for entry in lock.files:
        target = root.joinpath(*entry.path.split("/"))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(cache.path(entry.sha256), target)
            except OSError as e:
                if e.errno not in _LINK_FALLBACK:
                    raise
                shutil.copyfile(cache.path(entry.sha256), target)
        except OSError as e:
            raise PackageError(f"{LOCK_NAME}: cannot lay out {entry.path!r}: {e.strerror or e}") from None
    (root / LOCK_NAME).write_bytes(lock.to_json())


def _parallel(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """fn over items on a thread pool, results in order. The first error cancels the calls that
    have not started and is raised once the running ones finish."""
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        error = next((e for f in futures if f.done() and (e := f.exception()) is not None), None)
        if error is not None:
            for future in futures:
                future.cancel()
            raise error
        return [f.result() for f in futures]
