"""`ember verify`: a package directory matches its lock, file for file."""

from __future__ import annotations

from pathlib import Path

from ember.errors import PackageError
from ember.package.files import package_files
from ember.package.lock import LOCK_NAME, Lock, hash_file


def read_lock(root: Path) -> Lock:
    lock_path = root / LOCK_NAME
    if not lock_path.is_file():
        raise PackageError(f"{root}: no {LOCK_NAME} (run `ember build {root}` first)")
    return Lock.from_json(lock_path.read_bytes(), source=str(lock_path))


def verify_package(root: str | Path) -> Lock:
    """Check every locked file's size and sha256, and that no unlocked file was added.

    Raises PackageError naming the first file that disagrees.
    """
    root = Path(root)
    lock = read_lock(root)
    present = set(package_files(root))  # also refuses links that leave the package
    for entry in lock.files:
        path = root / entry.path
        if entry.path not in present:
            raise PackageError(f"{path}: listed in {LOCK_NAME} but missing")
        size, digest = hash_file(path)
        if size != entry.size:
            raise PackageError(f"{path}: size {size} differs from the lock's {entry.size}")
        if digest != entry.sha256:
            raise PackageError(f"{path}: sha256 {digest[:12]}… differs from the lock's {entry.sha256[:12]}…")
    extra = sorted(present - {f.path for f in lock.files})
    if extra:
        raise PackageError(f"{root}: files not in {LOCK_NAME}: {', '.join(extra[:5])}"
                           f"{' …' if len(extra) > 5 else ''} (run `ember build {root}`)")
    return lock
