"""Python side of `quantized_linear.c` for int8 weights: argument checks, the ctypes call, the torch reference."""

from __future__ import annotations

import ctypes

import torch

from ember_kernels.cpu.build import native_function
from ember_kernels.cpu.threads import THREADS

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_INT = ctypes.c_int
_ARGTYPES = [_PTR, _INT, _PTR, _PTR, _PTR, _INT, _I64, _I64, _I64, _INT]
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads and writes as is


def _function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native_function("ember_int8_linear", _ARGTYPES)  # type: ignore[return-value]


def int8_linear_available() -> bool:
    return _function() is not None


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """x [M, K] @ (qweight [N, K] int8 * scale [N]).T -> [M, N] in `out_dtype`; None if unavailable.

    CPU tensors only; computed in float32. x is read as is when float32 or bfloat16 (else converted
    to float32); a bfloat16 `out_dtype` is rounded from the float32 result in the kernel, other
    dtypes are converted after it. scale must be float32.
    """
    fn = _function()
    if fn is None:
        return None
    if qweight.dtype != torch.int8 or scale.dtype != torch.float32 or not (qweight.is_contiguous()
                                                                            and scale.is_contiguous()):
        raise ValueError("int8_linear needs a contiguous int8 weight and contiguous float32 scales")
    num_rows, in_features = x.shape
    out_features = qweight.shape[0]
    if qweight.shape[1] != in_features or scale.shape != (out_features,):
        raise ValueError(f"int8_linear: x {tuple(x.shape)}, weight {tuple(qweight.shape)} and scale "
                         f"{tuple(scale.shape)} do not fit")
    if x.dtype not in _NATIVE_DTYPES:
        x = x.float()
    x = x.contiguous()
    kernel_dtype = out_dtype if out_dtype in _NATIVE_DTYPES else torch.float32
    out = torch.empty(num_rows, out_features, dtype=kernel_dtype)
    # Decode-sized calls on one thread or torch's, as measured for this shape (threads.py).
    rc = THREADS.run(("int8_linear", num_rows, out_features, in_features), num_rows, fn, x.data_ptr(),
                     x.dtype == torch.bfloat16, qweight.data_ptr(), scale.data_ptr(), out.data_ptr(),
                     kernel_dtype == torch.bfloat16, num_rows, out_features, in_features)
    if rc != 0:
        return None
    return out if kernel_dtype == out_dtype else out.to(out_dtype)


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same map in torch ops (float32), to test the kernel against."""
    return x.float() @ (qweight.float() * scale.float()[:, None]).T
