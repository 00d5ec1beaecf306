"""Python side of `fused_ops.c`: RMSNorm (+ residual add), rotary and SiLU-and-mul in one call each.

Each function does the torch formula's arithmetic with its roundings (see the C file), or returns
None/False without touching anything when the kernel cannot take the inputs, so the caller runs its torch
path. They are called per layer per decode step, so the checks are kept to a few attribute reads: no
copies, no conversions.
"""

from __future__ import annotations

import ctypes

import torch

from ember_kernels.cpu.build import native_function

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_RMS_NORM_ARGS = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _INT, _INT]
_ROTARY_ARGS = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT, _INT]
_SILU_AND_MUL_ARGS = [_PTR, _PTR, _I64, _I64, _INT, _INT]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def fused_ops_available() -> bool:
    return native_function("ember_rms_norm", _RMS_NORM_ARGS) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """LlamaRMSNorm of h = x + residual (or of x): returns (weight * normed h, h); None if unsupported.

    x, residual: [..., D]; weight: [D]; all contiguous CPU tensors of one dtype, float32 or bfloat16. h is
    a new tensor (the inputs are left alone), or x itself without a residual.
    """
    fn = native_function("ember_rms_norm", _RMS_NORM_ARGS)
    dtype = _DTYPES.get(x.dtype)
    if (fn is None or dtype is None or not x.is_cpu or weight.dtype != x.dtype or not weight.is_cpu
            or not x.is_contiguous() or not weight.is_contiguous() or x.dim() == 0):
        return None
    dim = x.shape[-1]
    if dim == 0 or weight.numel() != dim:
        return None
    if residual is None:
        stream = x
    else:
        if (residual.dtype != x.dtype or not residual.is_cpu or residual.shape != x.shape
                or not residual.is_contiguous()):
            return None
        stream = torch.empty_like(x)  # x is contiguous, so this is too (cheaper than torch.empty(x.shape))
    out = torch.empty_like(x)
    rc = fn(x.data_ptr(), None if residual is None else residual.data_ptr(),
            None if residual is None else stream.data_ptr(), weight.data_ptr(), out.data_ptr(),
            x.numel() // dim, dim, eps, dtype, torch.get_num_threads())
    return (out, stream) if rc == 0 else None


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x [T, H, hd] in place, GPT-NeoX half split: x * cos + cat(-x2, x1) * sin; True if done.

    x's last two dims must be contiguous (stride(-1) == 1, stride(-2) == hd); its token stride may be
    larger, e.g. `qkv[:, :q_size].view(T, H, hd)`. cos, sin: contiguous [T, hd] (any shape with T * hd
    elements), x's dtype (float32 or bfloat16). False, x untouched, when the kernel cannot take them.
    """
    fn = native_function("ember_rotary", _ROTARY_ARGS)
    dtype = _DTYPES.get(x.dtype)
    if fn is None or dtype is None or x.dim() != 3 or not x.is_cpu:
        return False
    tokens, heads, head_dim = x.shape
    token_stride, head_stride, elem_stride = x.stride()
    if (elem_stride != 1 or head_stride != head_dim or cos.dtype != x.dtype or sin.dtype != x.dtype
            or not cos.is_cpu or not sin.is_cpu or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.numel() != tokens * head_dim or sin.numel() != tokens * head_dim):
        return False
    # The C side refuses odd head_dim and overlapping tokens before touching x.
    return fn(x.data_ptr(), tokens, heads, head_dim, token_stride, cos.data_ptr(), sin.data_ptr(), dtype,
              torch.get_num_threads()) == 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[..., :I]) * x[..., I:] for contiguous x [..., 2I] float32 or bfloat16 on the CPU; None if not."""
    fn = native_function("ember_silu_and_mul", _SILU_AND_MUL_ARGS)
    dtype = _DTYPES.get(x.dtype)
    if fn is None or dtype is None or not x.is_cpu or x.dim() == 0 or not x.is_contiguous():
        return None
    width = x.shape[-1]
    if width == 0 or width % 2:
        return None
    inter, rows = width // 2, x.numel() // width
    out = torch.empty(rows, inter, dtype=x.dtype)  # ints, not a shape tuple: a few us less per call
    if fn(x.data_ptr(), out.data_ptr(), rows, inter, dtype, torch.get_num_threads()) != 0:
        return None
    return out if x.dim() == 2 else out.view(*x.shape[:-1], inter)


_GATHER_ARGS = [_PTR, _PTR, _PTR, _I64, _I64, _INT, _INT]


def gather_columns(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor | None:
    """x[:, order] for contiguous 2-D CPU x of 2- or 4-byte elements and an int32 `order` of x's columns whose
    entries the caller has checked to lie in 0..cols-1 (the kernel does not, per call); None if not supported."""
    fn = native_function("ember_gather_columns", _GATHER_ARGS)
    esize = x.element_size()
    if (fn is None or not x.is_cpu or x.dim() != 2 or not x.is_contiguous() or esize not in (2, 4)
            or order.dtype != torch.int32 or order.shape != (x.shape[1],) or not order.is_contiguous()):
        return None
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype)
    if fn(x.data_ptr(), out.data_ptr(), order.data_ptr(), x.shape[0], x.shape[1], esize,
          torch.get_num_threads()) != 0:
        return None
    return out
