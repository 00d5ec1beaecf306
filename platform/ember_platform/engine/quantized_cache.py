"""The cold-start cache of quantized weights: the next start of the same weights with the same quantization
loads the quantized tensors (safetensors, memory-mapped) instead of loading full precision and quantizing.

Keyed by (weights digest, quantization method and options, dtype, device kind, torch version, the quantizer's
source): anything that could change the quantized tensors changes the key, so a stale entry is never used.
Entries live under `$EMBER_QUANTIZED_CACHE` (default `~/.cache/ember/quantized`), written atomically; a
corrupt or unreadable entry is a miss (and is rewritten). `EMBER_QUANTIZED_CACHE=off` disables it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_model
from torch import nn

log = logging.getLogger(__name__)

CACHE_ENV = "EMBER_QUANTIZED_CACHE"


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
            device: torch.device, quantizer: type) -> str:
        try:
            source = inspect.getsource(inspect.getmodule(quantizer) or quantizer)
        except (OSError, TypeError):
            source = quantizer.__qualname__
        parts = [weights_identity, method, json.dumps(dict(options), sort_keys=True, default=str), str(dtype),
                 device.type, torch.__version__, hashlib.sha256(source.encode()).hexdigest()]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return load_file(str(path))
        except (OSError, SafetensorError, ValueError) as e:
            log.warning("quantized-weight cache entry %s is unreadable (%s); quantizing again", path, e)
            return None

    def save(self, key: str, model: nn.Module) -> Path | None:
        path = self.path(key)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=self.root)
            os.close(fd)
            try:
                save_model(model, tmp)  # handles tied (shared) parameters
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, RuntimeError, ValueError) as e:  # a full disk must not fail the start
            log.warning("could not write the quantized-weight cache entry %s: %s", path, e)
            return None
        return path
