"""LoRA adapters in PEFT's layout (adapter_config.json + adapter_model.safetensors), checked and mapped
onto the model's layers: PEFT's per-projection A/B (q_proj, k_proj, ...) land on the output slices of our
packed layers (qkv_proj, gate_up_proj) through the model's own checkpoint-name mapping.

`inspect_adapter` reads only the config and the safetensors header, so an adapter is checked completely
when it is registered and its first use cannot fail on its contents; `load_adapter` reads the tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ember_platform.engine.lora_layer import LoRALayout

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")  # the manifest's rule for [[lora]] names

# PEFT saves `base_model.model.<module path>.lora_A.weight` (older versions keep the adapter name before
# `.weight`); the module path is the transformers model's, which our checkpoint mapping understands.
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
# Config keys whose non-empty value changes what the adapter computes in ways this engine does not serve.
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA (a magnitude vector per output)",
    "modules_to_save": "modules_to_save (whole modules replaced, not low-rank deltas)",
    "lora_bias": "a bias on lora_B",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D weights)",
    "layer_replication": "layer_replication (layers duplicated by the adapter)",
    "trainable_token_indices": "trainable_token_indices (embedding rows replaced)",
    "target_parameters": "target_parameters (LoRA on raw parameters such as stacked MoE experts)",
    "alora_invocation_tokens": "Activated LoRA (adapter switched on mid-sequence)",
    "use_qalora": "QALoRA (pooled inputs)",
    "use_bdlora": "BD-LoRA (block-diagonal factors)",
    "arrow_config": "Arrow routing between adapters",
    "kasa_config": "KaSA (a truncated base weight and a singular-value diagonal)",
}
# init_lora_weights values that rewrite the *base* weights: such an adapter is wrong on the original model.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_DIRECTIONS = "merge it into the base weights (PEFT's merge_and_unload) and serve the result as its own model"


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """One PEFT module's A/B pair and where it goes: a slice of one of our LoRA layers."""

    module: str  # our layer, e.g. "model.layers.0.self_attn.qkv_proj"
    slice_index: int  # which of its output slices (0 for an unpacked layer)
    a_key: str
    b_key: str
    rank: int
    scaling: float  # lora_alpha / r, or / sqrt(r) with rsLoRA


@dataclass(frozen=True, slots=True)
class LoRAAdapterSpec:
    """A checked adapter, not yet loaded: where its tensors are and where they go."""

    name: str
    path: Path
    rank: int  # the largest rank among its modules
    targets: tuple[LoRATarget, ...]
    digest: str  # sha256 of config + weights: an adapter's identity, since KV blocks are keyed by its name

    @property
    def weights_file(self) -> Path:
        return self.path / ADAPTER_WEIGHTS


# One loaded adapter: per LoRA layer, per output slice, (A [r, in], scaled B^T [r, size]) or None.
LoRAWeights = dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]
# PEFT module path ("model.layers.0.self_attn.q_proj") -> (our layer, shard id), or None if it has no place.
TargetMap = Callable[[str], tuple[str, Hashable | None] | None]


def check_adapter_name(name: str) -> str:
    if not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
        raise ValueError(f"{name!r} is not a valid adapter name: use lowercase letters, digits, '.', '_' and '-' "
                         "(at most 64, starting with a letter or digit)")
    return name


def inspect_adapter(name: str, path: str | Path, layouts: Mapping[str, LoRALayout], target_of: TargetMap,
                    *, max_rank: int | None = None) -> LoRAAdapterSpec:
    """Check a PEFT adapter directory against the model, reading its config and the safetensors header only."""
    root = Path(path)
    config_path, weights_path = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    if not config_path.is_file():
        raise LoRAAdapterError(f"LoRA adapter '{name}': no {ADAPTER_CONFIG} in {root} (PEFT layout expected: "
                               f"{ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}, as peft's save_pretrained writes them)")
    if not weights_path.is_file():
        hint = " (.bin adapters: re-save them with safe_serialization=True)" if (root / "adapter_model.bin").is_file() \
            else ""
        raise LoRAAdapterError(f"LoRA adapter '{name}': no {ADAPTER_WEIGHTS} in {root}{hint}")
    config_bytes = config_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise LoRAAdapterError(f"{config_path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_path}: expected a JSON object")
    _check_config(config, config_path)

    pairs: dict[str, dict[str, str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    with safe_open(str(weights_path), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            match = _LORA_KEY.match(key)
            if match is None:
                raise LoRAAdapterError(f"{weights_path}: tensor '{key}': {_explain_key(key)}")
            pairs.setdefault(match["module"], {})[match["ab"]] = key
            shapes[key] = tuple(f.get_slice(key).get_shape())
    if not pairs:
        raise LoRAAdapterError(f"{weights_path}: no LoRA tensors (expected '*.lora_A.weight' / '*.lora_B.weight')")

    targets = []
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAAdapterError(f"{weights_path}: module '{module}' has no {missing} tensor")
        targets.append(_target(module, ab["A"], ab["B"], shapes, config, layouts, target_of, weights_path))
    rank = max(t.rank for t in targets)
    if max_rank is not None and rank > max_rank:
        raise LoRAAdapterError(f"{config_path}: rank {rank} is above this engine's max_lora_rank ({max_rank}); "
                               "raise max_lora_rank")
    digest = hashlib.sha256()
    digest.update(config_bytes)
    with weights_path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return LoRAAdapterSpec(name, root, rank, tuple(targets), digest.hexdigest())


def _check_config(config: Mapping[str, Any], config_path: Path) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"{config_path}: 'peft_type' = {peft_type!r}: only LoRA adapters can be served")
    for key, what in _UNSUPPORTED.items():
        value = config.get(key)
        if value:  # None, False, [] and {} are the defaults: the feature is off
            raise LoRAAdapterError(f"{config_path}: '{key}' = {json.dumps(value)}: {what} is not supported by "
                                   f"Ember's multi-LoRA serving; {_DIRECTIONS}")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise LoRAAdapterError(f"{config_path}: 'bias' = {bias!r}: adapters that train biases are not supported by "
                               f"Ember's multi-LoRA serving (use bias=\"none\"), or {_DIRECTIONS}")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise LoRAAdapterError(f"{config_path}: 'init_lora_weights' = {init!r} also rewrites the base weights, so "
                               "the adapter is wrong on the original model; convert it to a plain LoRA when saving "
                               "(peft's path_initial_model_for_weight_conversion)")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise LoRAAdapterError(f"{config_path}: '{key}' must be a positive number, got {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise LoRAAdapterError(f"{config_path}: '{key}' must be an object of pattern -> number")


def _explain_key(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "a DoRA magnitude vector: DoRA adapters are not supported; " + _DIRECTIONS
    if "lora_embedding_" in key:
        return "a LoRA on an embedding: only linear projections can carry adapters here"
    if key.endswith(".bias"):
        return "a trained bias: only bias-free adapters (bias=\"none\", lora_bias=false) are supported"
    if "modules_to_save" in key or "original_module" in key:
        return "a module saved whole (modules_to_save): not supported; " + _DIRECTIONS
    return "not a LoRA tensor this engine understands (expected 'base_model.model.<module>.lora_A.weight' / lora_B)"


def _pattern_value(patterns: Mapping[str, Any], module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern matching the end of the module path."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(value)
    return default


def _target(module: str, a_key: str, b_key: str, shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any],
            layouts: Mapping[str, LoRALayout], target_of: TargetMap, weights_path: Path) -> LoRATarget:
    mapped = target_of(module)
    layer = mapped[0] if mapped else None
    if mapped is None or layer not in layouts:
        supported = sorted({m.rsplit(".", 1)[-1] for m in layouts})
        raise LoRAAdapterError(f"{weights_path}: tensor '{a_key}' targets '{module}', which cannot carry a LoRA in "
                               f"this engine (layers that can: {', '.join(supported) or 'none'}, through their "
                               "checkpoint projections such as q_proj, k_proj, v_proj, gate_proj, up_proj)")
    layout = layouts[layer]
    slice_index = layout.slice_index(mapped[1])
    if slice_index is None:
        raise LoRAAdapterError(f"{weights_path}: tensor '{a_key}': '{module}' maps to shard {mapped[1]!r} of "
                               f"'{layer}', which packs {[s for s, _, _ in layout.slices]}")
    a_shape, b_shape = shapes[a_key], shapes[b_key]
    size = layout.slices[slice_index][2]
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != layout.in_features or b_shape[0] != size \
            or a_shape[0] != b_shape[1] or a_shape[0] < 1:
        raise LoRAAdapterError(f"{weights_path}: '{module}': lora_A {list(a_shape)} / lora_B {list(b_shape)} do not "
                               f"fit the model (expected [r, {layout.in_features}] and [{size}, r]); is the adapter "
                               "for another base model?")
    rank = a_shape[0]
    config_rank = _pattern_value(config.get("rank_pattern") or {}, module, float(config["r"]))
    if rank != config_rank:
        raise LoRAAdapterError(f"{weights_path}: '{module}' has rank {rank} but the config says r = {config_rank:g}")
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, float(config["lora_alpha"]))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRATarget(layer, slice_index, a_key, b_key, rank, scaling)


def load_adapter(spec: LoRAAdapterSpec, layouts: Mapping[str, LoRALayout], dtype: torch.dtype,
                 *, pin_memory: bool = False) -> LoRAWeights:
    """Read an inspected adapter's tensors into host memory: A as saved, B transposed and scaled (in float32,
    then cast), in the compute dtype, so that filling a device slot is a plain copy."""
    weights: LoRAWeights = {}
    with safe_open(str(spec.weights_file), framework="pt", device="cpu") as f:
        for target in spec.targets:
            a = f.get_tensor(target.a_key).to(dtype)
            b_t = (f.get_tensor(target.b_key).float().T * target.scaling).to(dtype)
            if pin_memory:
                a, b_t = a.pin_memory(), b_t.pin_memory()
            slots = weights.setdefault(target.module, [None] * len(layouts[target.module].slices))
            slots[target.slice_index] = (a.contiguous(), b_t.contiguous())
    return weights
