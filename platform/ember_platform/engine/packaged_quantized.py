"""Quantized weights shipped inside a package (written once by `ember quantize`), so that every replica serving
it loads them instead of quantizing at start.

    quantized/<method>/model.safetensors    the quantized model's state dict (read back through each technique's
                                            `restored_method`, as the engine's cold-start cache does)
    quantized/<method>/quantization.json    method, options, dtype, the sha256 of every weight file it was made
                                            from, the layers' methods, the quality report and what the
                                            techniques decided (`techniques`: rotation's seed, mixed's plan)

Both files are ordinary package files: `ember build` locks them (content-addressed blobs like the weights) and
`ember verify` checks them. An entry is used only when the serving selection is the same method with the same
options and dtype and the weight files are the ones it was made from; otherwise the engine quantizes as usual.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model
from torch import nn

from ember.errors import PackageError
from ember.package.lock import LOCK_NAME, Lock, hash_file
from ember_platform.engine.linear_method import portable_parameters

log = logging.getLogger("ember.engine")

QUANTIZED_DIR = "quantized"
ENTRY_FILE = "quantization.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1


def entry_dir(package_root: Path, method: str) -> Path:
    return package_root / QUANTIZED_DIR / method


def weight_digests(package_root: Path, weights_dir: Path) -> dict[str, str]:
    """{path relative to the package: sha256} of the weight files, from the package's lock where it lists a file
    at its current size (a pulled package's lock was checked blob by blob), else hashed here."""
    root = package_root.resolve()
    locked: dict[str, tuple[int, str]] = {}
    try:
        lock = Lock.from_json((root / LOCK_NAME).read_bytes(), source=str(root / LOCK_NAME))
        locked = {f.path: (f.size, f.sha256) for f in lock.files}
    except (OSError, PackageError):
        pass
    digests = {}
    for path in sorted(p for p in weights_dir.resolve().rglob("*") if p.is_file() and not p.name.startswith(".")):
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        if rel.startswith(QUANTIZED_DIR + "/"):
            continue
        entry = locked.get(rel)
        digests[rel] = entry[1] if entry is not None and entry[0] == path.stat().st_size else hash_file(path)[1]
    return digests


def _options_json(options: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps(dict(options), sort_keys=True, default=str))


def find_entry(package_root: Path, weights_dir: Path, method: str, options: Mapping[str, Any],
               dtype: torch.dtype) -> Path | None:
    """The entry's directory when it was made for exactly this selection and these weights, else None."""
    where = entry_dir(package_root, method)
    try:
        entry = json.loads((where / ENTRY_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s); quantizing at start instead", where / ENTRY_FILE, e)
        return None
    wanted = {"format": FORMAT_VERSION, "method": method, "options": _options_json(options), "dtype": str(dtype)}
    differs = [key for key, value in wanted.items() if entry.get(key) != value]
    if differs:
        log.info("%s was made with another %s; quantizing at start instead", where, differs[0])
        return None
    if entry.get("weights") != weight_digests(package_root, weights_dir):
        log.warning("%s was made from other weights than the package's; quantizing at start instead", where)
        return None
    return where if (where / WEIGHTS_FILE).is_file() else None


def write_entry(package_root: Path, weights_dir: Path, method: str, options: Mapping[str, Any], dtype: torch.dtype,
                model: nn.Module, layer_methods: Mapping[str, str], report: Mapping[str, Any],
                states: Mapping[str, Any] | None = None) -> Path:
    """Write quantized/<method>/ (replacing an older entry) atomically; returns its directory. `states`: what each
    technique decided while quantizing (`Quantizer.state()`, by technique name: rotation's chosen seed, mixed's
    plan), handed back to them when a replica loads the entry."""
    target = entry_dir(package_root, method)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ember-tmp-", dir=target.parent))
    try:
        with portable_parameters(model):  # replicas may run other kernels (another CPU, a GPU): a portable layout
            save_model(model, str(tmp / WEIGHTS_FILE))  # handles tied (shared) parameters
        entry = {"format": FORMAT_VERSION, "method": method, "options": _options_json(options), "dtype": str(dtype),
                 "weights": weight_digests(package_root, weights_dir), "layers": dict(layer_methods),
                 "report": dict(report), "techniques": _options_json(states or {})}
        (tmp / ENTRY_FILE).write_text(json.dumps(entry, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def entry_states(where: Path) -> dict[str, Any]:
    """The techniques' saved states of the entry in `where` ({} for an entry written without them)."""
    try:
        entry = json.loads((where / ENTRY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{where / ENTRY_FILE}: {e}") from e
    states = entry.get("techniques", {}) if isinstance(entry, dict) else None
    if not isinstance(states, dict):
        raise ValueError(f"{where / ENTRY_FILE}: 'techniques' is not an object")
    return states


def remove_entry(package_root: Path, method: str) -> None:
    shutil.rmtree(entry_dir(package_root, method), ignore_errors=True)
