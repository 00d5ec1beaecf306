"""Python side of `hadamard.c`: the online rotation x Q, Q = diag(s) (R_m kron H_p), by a fast Walsh-Hadamard
transform (n log2 p additions per row instead of a dense [p, p] matmul per block)."""

from __future__ import annotations

import ctypes

import torch

from ember_kernels.cpu.build import native_function

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGS = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT, _INT]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, rt: torch.Tensor | None, m: int,
                    p: int) -> torch.Tensor | None:
    """x [..., m * p] (float32 or bfloat16, CPU) times Q, computed in float32 and returned in x's dtype; `signs`
    float32 [m * p], `rt` = R_m^T float32 [m, m] (None when m == 1). None when the kernel cannot take it."""
    fn = native_function("ember_hadamard_rotate", _ARGS)
    dtype = _DTYPES.get(x.dtype)
    n = m * p
    if (fn is None or dtype is None or not x.is_cpu or x.dim() == 0 or x.shape[-1] != n
            or signs.dtype != torch.float32 or signs.shape != (n,) or not signs.is_contiguous()):
        return None
    if m > 1 and (rt is None or rt.dtype != torch.float32 or rt.shape != (m, m) or not rt.is_contiguous()):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    rt_ptr = rt.data_ptr() if m > 1 and rt is not None else None
    if fn(x.data_ptr(), out.data_ptr(), signs.data_ptr(), rt_ptr, x.numel() // n, m, p, dtype,
          torch.get_num_threads()) != 0:
        return None
    return out
