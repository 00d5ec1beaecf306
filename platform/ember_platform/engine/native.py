"""The optional native CPU kernels (`ember_kernels.cpu`) as the engine reaches them: each looked up once.

Every getter returns None where the kernel is unavailable (no C compiler, `EMBER_NATIVE_KERNELS=0`,
`ember_kernels` not installed), and the caller keeps its torch path; the kernels themselves return
None/False for inputs they do not take (not on the CPU, other dtypes, other layouts).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

_loaded: dict[str, Any] = {}


def _once(key: str, load: Callable[[], Any]) -> Any:
    if key not in _loaded:
        try:
            _loaded[key] = load()
        except ImportError:
            _loaded[key] = None
    return _loaded[key]


def _load_dense_linear() -> Callable[..., torch.Tensor] | None:
    from ember_kernels.cpu.dense_linear import dense_linear_available, dense_linear_unchecked

    return dense_linear_unchecked if dense_linear_available() else None


def _load_fused_ops() -> ModuleType | None:
    from ember_kernels.cpu import fused_ops

    return fused_ops if fused_ops.fused_ops_available() else None


def _load_write_kv() -> Callable[..., bool] | None:
    from ember_kernels.cpu.paged_attention import paged_attention_available, write_kv

    return write_kv if paged_attention_available(torch.float32) else None


def dense_linear() -> Callable[..., torch.Tensor] | None:
    """The small-batch linear (`ember_kernels.cpu.dense_linear.dense_linear_unchecked`), or None."""
    return _once("dense_linear", _load_dense_linear)


def fused_ops() -> ModuleType | None:
    """`ember_kernels.cpu.fused_ops` (rms_norm, rotary_, silu_and_mul), or None."""
    return _once("fused_ops", _load_fused_ops)


def write_kv() -> Callable[..., bool] | None:
    """The KV-cache slot copy (`ember_kernels.cpu.paged_attention.write_kv`), or None."""
    return _once("write_kv", _load_write_kv)


def tracks_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records ops on any of these: the native kernels are forward-only."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
