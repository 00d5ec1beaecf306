"""Python side of `dense_linear.c`: argument checks and the ctypes call.

`dense_linear(x, weight, bias)` is `F.linear` for a few rows of x (decode, speculative verification),
float32 out; it streams the weights once for all rows, where MKL's GEMM on AVX2 CPUs costs several
times its one-row GEMV per extra row.
"""

from __future__ import annotations

import ctypes

import torch

from ember_kernels.cpu.build import native_library
from ember_kernels.cpu.threads import THREADS

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int]
_BF16_IO = "bf16 io"  # the kernel taking bfloat16 x and writing bfloat16 y (a bf16 model's layers)
_functions: dict[object, ctypes._CFuncPtr] | None = None  # type: ignore[name-defined]


def _kernels() -> dict[object, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    global _functions
    if _functions is None:
        lib = native_library()
        if lib is None:
            return None
        functions = {torch.float32: lib.ember_dense_linear_f32, torch.bfloat16: lib.ember_dense_linear_bf16,
                     _BF16_IO: lib.ember_dense_linear_bf16_io}
        for fn in functions.values():
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        _functions = functions
    return _functions


def dense_linear_available() -> bool:
    return _kernels() is not None


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] float32; None if the kernel is unavailable.

    CPU tensors only. weight: contiguous float32 or bfloat16 (widened to float32 in the kernel); x and
    bias are used as float32 (converted if they are not). Meant for small M: it has no cache blocking
    over rows, so for prefill-sized M a GEMM is faster.
    """
    kernels = _kernels()
    if kernels is None:
        return None
    if weight.dtype not in kernels or not weight.is_contiguous():
        raise ValueError(f"dense_linear needs a contiguous float32 or bfloat16 weight, got {weight.dtype}")
    _, in_features = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != in_features or (bias is not None and bias.shape != (out_features,)):
        raise ValueError(f"dense_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit")
    return _call(weight.dtype, x.float(), weight, bias, torch.float32)


def dense_linear_unchecked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`dense_linear` for a caller that has checked everything (the model's linear layers, per step):
    the kernel is available, weight is contiguous float32 or bfloat16 [N, K], x is [M, K] on the CPU."""
    return _call(weight.dtype, x.float(), weight, bias, torch.float32)


def dense_linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bfloat16 model's small linear, checked by its caller as `dense_linear_unchecked`, x and weight bfloat16:
    x [M, K] @ weight.T (+ bias) computed in float32 and rounded to bfloat16 [M, N] in the kernel, with no
    conversion ops around it (each a dispatch a decode step's ~50 linears would pay twice)."""
    return _call(_BF16_IO, x, weight, bias, torch.bfloat16)


def _call(kernel: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          out_dtype: torch.dtype) -> torch.Tensor:
    """`_functions[kernel]` on x (in the dtype that kernel reads) into a new [M, N] tensor of `out_dtype`."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    x = x.contiguous()
    bias32 = None if bias is None else bias.float().contiguous()
    out = torch.empty(num_rows, out_features, dtype=out_dtype)
    # Decode-sized calls on one thread or torch's, as measured for this shape (threads.py).
    rc = THREADS.run(("dense_linear", kernel, num_rows, out_features, in_features), num_rows,
                     _functions[kernel], x.data_ptr(), weight.data_ptr(),  # type: ignore[index]
                     None if bias32 is None else bias32.data_ptr(), out.data_ptr(), num_rows, out_features, in_features)
    if rc != 0:
        raise ValueError(f"dense_linear: bad sizes M={num_rows} N={out_features} K={in_features}, or no memory")
    return out
