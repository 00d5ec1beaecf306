"""`ember build`: validate a package and write its `ember.lock`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ember.errors import PackageError
from ember.manifest import MANIFEST_NAME, Manifest, load_manifest
from ember.package.files import package_files
from ember.package.lock import LOCK_NAME, Lock, LockedFile, hash_file

if TYPE_CHECKING:
    from ember.plugins import PluginHost


def lock_package(root: Path, manifest: Manifest) -> Lock:
    """Hash every package file into a Lock (does not write it)."""
    files = []
    for rel in package_files(root):
        size, digest = hash_file(root / rel)
        files.append(LockedFile(rel, size, digest))
    return Lock(manifest.model.name, manifest.model.version, tuple(sorted(files)))


def build_package(root: str | Path, host: PluginHost | None = None) -> Lock:
    """Validate the manifest (and its technique names, when `host` is given) and write the lock.

    Building twice gives the same bytes; the lock is rewritten only when it changed.
    """
    root = Path(root)
    if not root.is_dir():
        raise PackageError(f"{root}: not a directory")
    manifest = load_manifest(root / MANIFEST_NAME)
    if host is not None:
        host.check_manifest(manifest, source=str(root / MANIFEST_NAME))
    check_weights(root, manifest)
    lock = lock_package(root, manifest)
    data = lock.to_json()
    lock_path = root / LOCK_NAME
    if not lock_path.is_file() or lock_path.read_bytes() != data:
        tmp = root / f".ember-tmp-{LOCK_NAME}"
        tmp.write_bytes(data)
        tmp.replace(lock_path)
    return lock


def check_weights(root: Path, manifest: Manifest) -> None:
    """The weights directory must hold a Hugging Face checkpoint in safetensors."""
    weights = root / manifest.model.weights
    where = f"{root / MANIFEST_NAME}: model.weights"
    if not (weights / "config.json").is_file():
        raise PackageError(f"{where}: {weights} has no config.json (a Hugging Face checkpoint is expected)")
    if not any(weights.glob("*.safetensors")):
        raise PackageError(f"{where}: {weights} has no *.safetensors file")
