"""Kernel-op impls over `ember_kernels.cpu`: each declines (returns None/False) what its C kernel does not take.

The kernels check devices, dtypes and layouts themselves; these add what only a caller knows (the kernels are
forward-only, so a tensor that needs gradients is declined; the linear's row limit). Each module attribute is None
where the native library is unavailable on this machine, so the engine's table skips it.
"""

from __future__ import annotations

import torch

from ember_kernels.cpu import fused_ops
from ember_kernels.cpu.dense_linear import dense_linear_available, dense_linear_bf16, dense_linear_unchecked
from ember_kernels.cpu.paged_attention import paged_attention_available
from ember_kernels.cpu.paged_attention import write_kv as native_write_kv

# The most rows the native linear takes: per row it costs about what one row does (it is bound by the weights'
# bytes at 1 row, by FMAs beyond), while MKL's GEMM gains on it with more rows; they were about even at 16 rows on
# tiny-llama's lm_head (4096x256) on an AVX2 EPYC, the native kernel 1.1-3x faster below that (MKL's float32 GEMM
# costs 2-4x its one-row GEMV per row there). Prefill chunks go to MKL.
NATIVE_LINEAR_MAX_ROWS = 16
# A bfloat16 model's (x, weights and output bf16): on llama-150m's shapes, weights out of cache, a 2-core Zen 5 VM
# (AVX512-BF16), the native kernel took 0.3-0.6x the time of oneDNN's bf16 GEMM at 1-4 rows, about the same at 8,
# ~1.3x at 16: its float32 FMAs cost more per row than oneDNN's bf16 dot products once the weights' bytes do not
# bound both.
NATIVE_BF16_LINEAR_MAX_ROWS = 4
_NATIVE_LINEAR_ROWS = {torch.float32: NATIVE_LINEAR_MAX_ROWS, torch.bfloat16: NATIVE_BF16_LINEAR_MAX_ROWS}


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (residual is not None and residual.requires_grad)):
        return None
    return fused_ops.rms_norm(x, weight, eps, residual)


def _native_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return None
    return fused_ops.silu_and_mul(gate_up)


def _native_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    return x if fused_ops.rotary_(x, cos, sin) else None


def _native_write_kv(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                     slot_mapping: torch.Tensor, scratch: dict | None = None) -> bool:
    return native_write_kv(kv_cache[0], kv_cache[1], k, v, slot_mapping)


def _native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    # It sums each row in one fixed order whatever the row count, so a row's output does not depend on the rows
    # sharing its step (drafts verified, sequences batched).
    if x.dtype != weight.dtype or x.dtype not in _NATIVE_LINEAR_ROWS or not x.is_cpu or not weight.is_cpu:
        return None
    in_features = weight.shape[-1]
    if (not 0 < x.numel() <= _NATIVE_LINEAR_ROWS[x.dtype] * in_features or x.shape[-1] != in_features
            or weight.dim() != 2 or not weight.is_contiguous()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    rows = x.reshape(-1, in_features)
    kernel = dense_linear_unchecked if x.dtype == torch.float32 else dense_linear_bf16
    y = kernel(rows, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


_FUSED = fused_ops.fused_ops_available()
rms_norm = _native_rms_norm if _FUSED else None
silu_and_mul = _native_silu_and_mul if _FUSED else None
rotary = _native_rotary if _FUSED else None
write_kv = _native_write_kv if paged_attention_available(torch.float32) else None
linear = _native_linear if dense_linear_available() else None
