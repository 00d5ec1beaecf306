"""The cold-start cache of quantized weights: the next start of the same weights with the same quantization
loads the quantized tensors instead of loading full precision and quantizing.

An entry is a checkpoint directory (`<key>/model.safetensors`, the quantized model's state dict) that the generic
loader reads like any other, each layer through the method its technique restores it with
(`Quantizer.restored_method`). Keyed by (weights digest, quantization methods and options, dtype, device kind,
torch version, the source of the quantizers' modules and their siblings): anything that could change the
quantized tensors changes the key, so a stale entry is never used. Entries live under `$EMBER_QUANTIZED_CACHE`
(default `~/.cache/ember/quantized`), written atomically; a corrupt or unreadable entry is a miss (and is
rewritten). `EMBER_QUANTIZED_CACHE=off` disables it.

Beside the weights, `quantization.json` holds what the techniques decided while quantizing (`Quantizer.state()`:
mixed precision's per-layer plan) and which weights and selection the entry is for, so that a restore can give
the techniques their state back and `ember explain` can print it without torch.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model
from torch import nn

from ember_platform.engine.linear_method import portable_parameters

log = logging.getLogger(__name__)

CACHE_ENV = "EMBER_QUANTIZED_CACHE"
STATE_FILE = "quantization.json"


def _sibling_sources(quantizer: type) -> list[str]:
    """The source files beside the quantizer's module: a technique split into modules (gptq's algorithm lives
    beside its Quantizer) changes its tensors when any of them changes. Read from disk, so the key does not
    depend on which of them happen to be imported yet."""
    module = inspect.getmodule(quantizer)
    path = getattr(module, "__file__", None)
    if not path:
        return []
    folder = Path(path).parent
    return [f"{p.name}\n{p.read_text(encoding='utf-8', errors='replace')}" for p in sorted(folder.glob("*.py"))]


class QuantizedWeightCache:
    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def default(cls) -> QuantizedWeightCache | None:
        value = os.environ.get(CACHE_ENV, "")
        if value.lower() in ("off", "0", "false", "none"):
            return None
        return cls(Path(value) if value else Path.home() / ".cache" / "ember" / "quantized")

    @staticmethod
    def key(weights_identity: str, method: str, options: Mapping[str, Any], dtype: torch.dtype,
            device: torch.device, quantizers: Sequence[type]) -> str:
        sources = []
        for quantizer in quantizers:
            try:
                sources.append(inspect.getsource(inspect.getmodule(quantizer) or quantizer))
            except (OSError, TypeError):
                sources.append(quantizer.__qualname__)
            sources += _sibling_sources(quantizer)
        digest = hashlib.sha256("\n".join(sources).encode()).hexdigest()
        parts = [weights_identity, method, json.dumps(dict(options), sort_keys=True, default=str), str(dtype),
                 device.type, torch.__version__, digest]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        """The entry's checkpoint directory (it holds one model.safetensors)."""
        return self.root / key

    def lookup(self, key: str) -> Path | None:
        """The entry's directory if it was written completely, else None (a miss)."""
        path = self.path(key)
        return path if (path / "model.safetensors").is_file() else None

    def discard(self, key: str) -> None:
        """Remove an entry found unreadable, so that this start's save replaces it."""
        shutil.rmtree(self.path(key), ignore_errors=True)

    def state(self, key: str) -> dict[str, Any]:
        """The entry's `quantization.json` ({} for an entry written without one); ValueError if unreadable."""
        path = self.path(key) / STATE_FILE
        if not path.is_file():
            return {}
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: {e}") from e
        if not isinstance(state, dict):
            raise ValueError(f"{path}: not a JSON object")
        return state

    def save_state(self, key: str, state: Mapping[str, Any]) -> Path | None:
        """Write only an entry's `quantization.json` (techniques that cannot restore their layers still keep what
        they decided where `ember explain` looks); the entry stays a miss for `lookup`."""
        path = self.path(key)
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(state, indent=1, sort_keys=True, default=str) + "\n")
            os.replace(tmp, path / STATE_FILE)
        except OSError as e:
            log.warning("could not write %s: %s", path / STATE_FILE, e)
            return None
        return path / STATE_FILE

    def save(self, key: str, model: nn.Module, state: Mapping[str, Any] | None = None) -> Path | None:
        path = self.path(key)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(suffix=".tmp", dir=self.root))
            try:
                with portable_parameters(model):  # a kernel's machine-specific layout is saved portably
                    save_model(model, str(tmp / "model.safetensors"))  # handles tied (shared) parameters
                if state:
                    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True, default=str) + "\n",
                                                  encoding="utf-8")
                shutil.rmtree(path, ignore_errors=True)
                os.replace(tmp, path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except (OSError, RuntimeError, ValueError) as e:  # a full disk must not fail the start
            log.warning("could not write the quantized-weight cache entry %s: %s", path, e)
            return None
        return path
