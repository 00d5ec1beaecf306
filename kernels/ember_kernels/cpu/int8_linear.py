"""Python side of `int8_linear.c`: argument checks and the ctypes call, and the torch reference."""

from __future__ import annotations

import ctypes

import torch

from ember_kernels.cpu.build import native_function

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int]


def _function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native_function("ember_int8_linear", _ARGTYPES)  # type: ignore[return-value]


def int8_linear_available() -> bool:
    return _function() is not None


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ (qweight [N, K] int8 * scale [N]).T -> [M, N] float32; None if unavailable.

    CPU tensors only; x is used as float32 (converted if it is not), scale must be float32.
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
    x32 = x.float().contiguous()
    out = torch.empty(num_rows, out_features, dtype=torch.float32)
    rc = fn(x32.data_ptr(), qweight.data_ptr(), scale.data_ptr(), out.data_ptr(), num_rows, out_features,
            in_features, torch.get_num_threads())
    return out if rc == 0 else None


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same map in torch ops (float32), to test the kernel against."""
    return x.float() @ (qweight.float() * scale.float()[:, None]).T
