"""The generic checkpoint loader: Hugging Face safetensors (one file or sharded with an index) into a model.

The model is built on the meta device; loading allocates each parameter once, empty, on the
model's device and copies the memory-mapped checkpoint tensor into it (`safe_open`), so a
checkpoint is read once and never held twice. How each checkpoint tensor lands in the model is
the model's business (`model.checkpoint_target(name)` and each parameter's `weight_loader`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ember_platform.engine.models.layers import default_weight_loader

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """What `load_weights` read: the files, how many tensors, how many bytes."""

    files: tuple[Path, ...]
    num_tensors: int
    num_bytes: int


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those the index names, or the single file."""
    root = Path(checkpoint_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (expected a 'weight_map' object): {e}") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names files that are not there: {', '.join(missing)}")
        return files
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (only safetensors checkpoints are supported; "
                                "convert .bin/.pt checkpoints with transformers' save_pretrained)")
    return files


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every parameter still on the meta device uninitialized storage on `device`.

    Floating-point parameters get `dtype`; others (e.g. packed int weights) keep theirs. A
    parameter shared by two modules (tied embeddings) stays shared. Attributes set on the
    parameter (its `weight_loader`) carry over.
    """
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            if id(param) not in done:
                new_dtype = dtype if param.is_floating_point() else param.dtype
                new = nn.Parameter(torch.empty(param.shape, dtype=new_dtype, device=device), requires_grad=False)
                new.__dict__.update(param.__dict__)
                done[id(param)] = new
            setattr(module, name, done[id(param)])


def load_weights(model: nn.Module, checkpoint_dir: str | Path, *, strict: bool = True) -> LoadedWeights:
    """Fill `model` (built on the meta device by `build_model`) from a safetensors checkpoint.

    The model provides `dtype`, `device` and `checkpoint_target(name) -> (param_name, shard_id) |
    None`; each parameter's optional `weight_loader(param, tensor, shard_id)` copies the tensor in.

    Every parameter must be filled completely; with `strict`, every checkpoint tensor must have a
    place in the model (the model may skip some on purpose, e.g. rotary buffers).
    """
    files = checkpoint_files(checkpoint_dir)
    materialize(model, model.device, model.dtype)
    params = dict(model.named_parameters())
    filled: dict[str, int] = defaultdict(int)
    num_tensors = num_bytes = 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = model.checkpoint_target(name)
                if target is None:
                    continue
                param_name, shard_id = target
                param = params.get(param_name)
                if param is None:
                    if strict:
                        raise ValueError(f"{path}: tensor '{name}' has no place in {type(model).__name__} "
                                         f"(it maps to '{param_name}'); is this checkpoint for another architecture?")
                    continue
                tensor = f.get_tensor(name)
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"{path}: tensor '{name}' -> parameter '{param_name}': {e}") from None
                filled[param_name] += tensor.numel()
                num_tensors += 1
                num_bytes += tensor.numel() * tensor.element_size()
    incomplete = [name for name, param in params.items() if filled[name] < param.numel()]
    if incomplete:
        shown = ", ".join(incomplete[:8]) + (f" and {len(incomplete) - 8} more" if len(incomplete) > 8 else "")
        raise ValueError(f"checkpoint {checkpoint_dir} does not provide (all of) these parameters: {shown}")
    return LoadedWeights(tuple(files), num_tensors, num_bytes)
