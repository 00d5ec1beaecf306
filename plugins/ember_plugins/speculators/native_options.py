"""The options of a speculator with a native CPU drafting kernel (eagle3, draft, medusa): `native_draft` (true,
false, or unset: where it runs) and `native_draft_weights` (how the kernel keeps its matrices), checked alike for
all."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def native_draft_choice(options: Mapping[str, Any], formats: Sequence[str]) -> tuple[bool | None, str]:
    """(native_draft: True / False / None for "where it runs", the weight format), or ValueError naming the option."""
    wanted = options.get("native_draft")
    weight_format = options.get("native_draft_weights", "int8")
    if wanted is not None and not isinstance(wanted, bool):
        raise ValueError(f"speculator.options.native_draft must be true or false, got {wanted!r}")
    if weight_format not in formats:
        raise ValueError(f"speculator.options.native_draft_weights must be one of {', '.join(formats)}, got "
                         f"{weight_format!r}")
    if wanted is False and "native_draft_weights" in options:
        raise ValueError("speculator.options.native_draft_weights is for the native kernel, which "
                         "speculator.options.native_draft = false turns off")
    return wanted, weight_format


def native_kernel_blocker(context: Any, unsupported: str | None, kernel_module: str, available: str) -> str | None:
    """Why the native kernel in `kernel_module` cannot run for this speculator (None: it can). `unsupported`: the
    speculator's own reason (its weights are not what the kernel reads), checked after the engine's device and dtype;
    `available`: the module's function saying whether the compiled kernels loaded."""
    if context.device.type != "cpu" or context.dtype != torch.float32:
        return f"it runs on CPU in float32 (this engine: {context.device.type}, {context.dtype})"
    if unsupported is not None:
        return unsupported
    try:
        module = importlib.import_module(kernel_module)
    except ImportError:
        return "ember_kernels is not installed"
    if not getattr(module, available)():
        return "the native CPU kernels are unavailable on this machine"
    return None


def refuse_if_required(wanted: bool | None, why: str) -> None:
    """The kernel cannot run (`why`): an error where `native_draft = true` required it, else the torch path."""
    if wanted:
        raise ValueError(f"speculator.options.native_draft is true, but {why}")
