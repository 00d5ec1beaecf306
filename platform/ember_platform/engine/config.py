"""Where the engine's settings come from: an Ember package's manifest (or a bare Hugging Face
checkpoint's defaults), then keyword overrides — `LLM(path, max_num_seqs=8, quantization="int8")`."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.manifest import MANIFEST_NAME, Manifest, load_manifest, parse_manifest

# Override keyword -> (manifest section, field). Runtime fields keep their own names.
_OVERRIDES: dict[str, tuple[str, str]] = {
    **{name: ("runtime", name) for name in ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                                            "kv_block_size", "kv_cache_memory_gb", "memory_utilization",
                                            "enable_prefix_caching", "accelerator", "seed", "kv_cache_dtype")},
    "quantization": ("quantization", "method"),
    "quantization_options": ("quantization", "options"),
    "speculator": ("speculator", "method"),
    "num_speculative_tokens": ("speculator", "num_speculative_tokens"),
    "speculator_max_batch_size": ("speculator", "max_batch_size"),
    "speculator_adaptive": ("speculator", "adaptive"),
    "speculator_model": ("speculator", "model"),
    "speculator_options": ("speculator", "options"),
    "attention": ("kernels", "attention"),
    "attention_options": ("kernels", "options"),
    "parallelism": ("parallelism", "strategy"),
    "tensor_parallel": ("parallelism", "tensor_parallel"),
}
# Engine-only knobs that have no manifest field (tests and benchmarks use them). `kv_tiers`: a mapping of
# kvtiers.KVTierConfig fields (CPU / disk / S3 tiers below the device), or a KVTierConfig.
_ENGINE_ONLY = {"num_kv_blocks", "kv_tiers"}


def override_value(text: str) -> Any:
    """An override as a command line or the admin API carries it (text): JSON when it is JSON (`8`, `true`,
    `{"bits": 4}`), else the string itself (`int8`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass(slots=True)
class ModelSource:
    """What `LLM(path)` was pointed at."""

    root: Path  # the package dir, or the checkpoint dir itself
    weights_dir: Path
    manifest: Manifest
    is_package: bool


def resolve_source(path: str | Path, overrides: dict[str, Any]) -> tuple[ModelSource, dict[str, Any]]:
    """Load the manifest for `path` and apply overrides; returns the source and engine-only knobs."""
    root = Path(path)
    unknown = [k for k in overrides if k not in _OVERRIDES and k not in _ENGINE_ONLY]
    if unknown:
        valid = sorted([*_OVERRIDES, *_ENGINE_ONLY])
        hints = [difflib.get_close_matches(k, valid, n=1) for k in unknown]
        detail = "; ".join(f"'{k}'" + (f" (did you mean '{h[0]}'?)" if h else "") for k, h in zip(unknown, hints,
                                                                                                   strict=True))
        raise TypeError(f"unknown engine option {detail}; valid options: {', '.join(valid)}")
    if (root / MANIFEST_NAME).is_file():
        manifest = load_manifest(root)
        is_package = True
        weights_dir = root / manifest.model.weights
    elif (root / "config.json").is_file():
        name = "".join(c if c.isalnum() or c in "._-" else "-" for c in root.resolve().name.lower()).strip("-._")
        manifest = parse_manifest({"model": {"name": name or "model", "version": "0", "weights": "."}},
                                  source=str(root / "config.json"))
        is_package = False
        weights_dir = root
    else:
        raise FileNotFoundError(f"{root}: neither an Ember package ({MANIFEST_NAME}) nor a Hugging Face "
                                "checkpoint (config.json)")
    data = manifest.model_dump(exclude_unset=True)
    for key, value in overrides.items():
        if key in _OVERRIDES and value is not None:
            section, field = _OVERRIDES[key]
            data.setdefault(section, {})[field] = value
    manifest = parse_manifest(data, source=f"{root} (with overrides)", package_dir=root if is_package else None)
    engine_only = {k: v for k, v in overrides.items() if k in _ENGINE_ONLY}
    return ModelSource(root, weights_dir, manifest, is_package), engine_only


def read_hf_config(weights_dir: Path) -> dict[str, Any]:
    path = weights_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the model's config ({e})") from None
