"""`ember build`: validate a package and write its `ember.lock`."""

from __future__ import annotations

import json
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
    check_speculator_model(root, manifest)
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


def _tokenizer_identity(path: Path) -> object:
    """What makes two tokenizer.json files tokenize alike: the model (vocab, merges), added tokens, pre-tokenizer."""
    data = json.loads(path.read_text())
    return (data.get("model"), [(t.get("id"), t.get("content")) for t in data.get("added_tokens") or []],
            data.get("pre_tokenizer"), data.get("normalizer"))


def check_speculator_model(root: Path, manifest: Manifest) -> None:
    """A `[speculator] model` directory (a draft model, Medusa heads, an EAGLE head) must speak the target's tokens:
    the vocab_size its config.json states, and the tokenizer.json it carries, if any, must be the target's."""
    if manifest.speculator.model is None:
        return
    where = f"{root / MANIFEST_NAME}: speculator.model"
    model_dir = root / manifest.speculator.model
    weights = root / manifest.model.weights
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return  # the speculator plugin decides at load what its directory holds
    try:
        config, target = json.loads(config_path.read_text()), json.loads((weights / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PackageError(f"{where}: cannot read {config_path} or the target's config.json: {e}") from None
    if isinstance(config, dict) and "vocab_size" in config and config["vocab_size"] != target.get("vocab_size"):
        raise PackageError(f"{where}: {config_path}: vocab_size is {config['vocab_size']}, the target's is "
                           f"{target.get('vocab_size')} (a speculator must use the target's tokenizer)")
    tokenizer, target_tokenizer = model_dir / "tokenizer.json", weights / "tokenizer.json"
    if tokenizer.is_file() and target_tokenizer.is_file():
        try:
            same = _tokenizer_identity(tokenizer) == _tokenizer_identity(target_tokenizer)
        except (OSError, ValueError) as e:
            raise PackageError(f"{where}: cannot read {tokenizer}: {e}") from None
        if not same:
            raise PackageError(f"{where}: {tokenizer} is not the target's tokenizer ({target_tokenizer})")
