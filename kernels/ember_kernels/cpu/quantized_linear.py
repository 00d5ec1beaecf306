"""Python side of `quantized_linear.c` for fp8 (e4m3) weights and for the large-batch path of int8 and fp8:
argument checks, the ctypes calls, and the torch references.

Two ways to compute x @ (qweight * scale).T, and which is faster depends on the rows of x:

* `fp8_linear` (and `int8_linear` in `int8_linear.py`): the weights streamed once for all rows and widened in
  registers. Bound by the weights' bytes at a few rows, which is where a quantized weight wins; beyond that
  its 8-lane float32 FMAs (and the widening per 4 rows) fall behind a GEMM library.
* `int8_gemm` (int8 weights only): each row of x quantized to int8 with its own scale, then an exact int8 GEMM
  (on CPUs with AMX-INT8 `ember_amx_int8_gemm`'s TDPBSSD, twice TDPBF16PS's products per instruction; else
  `torch._int_mm`: oneDNN's VNNI kernels, four multiply-adds per lane where bf16 does two), the int32 sums
  scaled back per row and channel. W8A8, so its numbers differ slightly from the weight-only kernels'.
* `bf16_gemm` (bf16 activations, CPUs with AVX512_BF16): a tile of 12 weight rows at a time widened exactly into
  bf16 in a per-thread buffer, and vdpbf16ps dot products (16 float32 lanes of two bf16 products each) with the
  rows of x as the vector operand: register-tiled 32 rows x 12 outputs. Weight-only, the weights read once per
  call whatever M is, one float32 chain per output in k order (a row's numbers never depend on its batch). On
  llama-150m's shapes 1.1-2x the bf16 dense GEMM at 8-64 rows, where the float32 kernels above and the tiled
  path below fall behind it; near parity on prefill chunks, where both run the same instruction at its peak.
* `amx_gemm` (bf16 activations, CPUs with AMX, amx_gemm.c): `bf16_gemm`'s map on the tile unit (TDPBF16PS), the
  weights widened into its layout a block at a time. Where the CPU has AMX, oneDNN's dense bf16 GEMM uses it too,
  so this is the path that keeps up with it beyond a few rows.
* `tiled_linear`: a tile of weight rows at a time widened exactly into the activations' dtype (int8 and e4m3
  values are all bfloat16 numbers) in a scratch buffer that stays in cache, multiplied by torch's GEMM
  (oneDNN's bf16 or MKL's float32 kernels), and each output column scaled once. So a prefill chunk runs near
  the dense GEMM's speed without a full-precision copy of the weights: only one tile exists at a time.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch

from ember_kernels.cpu.build import native_function
from ember_kernels.cpu.threads import THREADS

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_LINEAR_ARGTYPES = [_PTR, _INT, _PTR, _PTR, _PTR, _INT, _I64, _I64, _I64, _INT]
_WIDEN_ARGTYPES = [_PTR, _INT, _PTR, _INT, _I64, _INT]
_QUANTIZE_ROWS_ARGTYPES = [_PTR, _INT, _PTR, _PTR, _I64, _I64, _INT]
_SCALE_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _INT, _I64, _I64, _INT]
_BF16_GEMM_ARGTYPES = [_PTR, _PTR, _INT, _PTR, _PTR, _INT, _I64, _I64, _I64, _INT]
_AMX_INT8_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _PTR, _INT, _I64, _I64, _I64, _INT]
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write as is
_KINDS = {torch.int8: 0, torch.float8_e4m3fn: 1}
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# Elements of one widened tile: 4 MiB of bf16 (8 MiB of float32), inside the L3 of the CPU measured (32 MiB),
# so the GEMM reads the tile from cache. Smaller tiles pay the GEMM's fixed cost per call more often: on
# llama-150m's shapes at 16-512 rows, 256 KiB tiles ran at 0.32-0.78x of the dense bf16 GEMM, 4 MiB at 0.82-0.93x.
TILE_ELEMENTS = 1 << 21


def _fp8_function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native_function("ember_fp8_linear", _LINEAR_ARGTYPES)  # type: ignore[return-value]


def _widen_function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native_function("ember_widen_weights", _WIDEN_ARGTYPES)  # type: ignore[return-value]


def fp8_linear_available() -> bool:
    return _fp8_function() is not None


def widen_available() -> bool:
    return _widen_function() is not None


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """x [M, K] @ (qweight [N, K] float8_e4m3fn * scale [N]).T -> [M, N] in `out_dtype`; None if unavailable.

    CPU tensors; computed in float32, as `int8_linear` (same reading of x and writing of the output)."""
    fn = _fp8_function()
    if fn is None:
        return None
    _check(x, qweight, scale, torch.float8_e4m3fn, "fp8_linear")
    if x.dtype not in _NATIVE_DTYPES:
        x = x.float()
    x = x.contiguous()
    kernel_dtype = out_dtype if out_dtype in _NATIVE_DTYPES else torch.float32
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=kernel_dtype)
    # Decode-sized calls on one thread or torch's, as measured for this shape (threads.py).
    rows, out_features, in_features = x.shape[0], qweight.shape[0], qweight.shape[1]
    rc = THREADS.run(("fp8_linear", rows, out_features, in_features), rows, fn, x.data_ptr(),
                     x.dtype == torch.bfloat16, qweight.data_ptr(), scale.data_ptr(), out.data_ptr(),
                     kernel_dtype == torch.bfloat16, rows, out_features, in_features)
    if rc != 0:
        return None
    return out if kernel_dtype == out_dtype else out.to(out_dtype)


def widen_weights(qweight: torch.Tensor, out: torch.Tensor) -> bool:
    """Write `qweight` (contiguous int8 or float8_e4m3fn) into `out` (contiguous float32 or bfloat16, as many
    elements), exactly; False when the native kernels are unavailable."""
    fn = _widen_function()
    if fn is None:
        return False
    kind = _KINDS.get(qweight.dtype)
    if kind is None or out.dtype not in _NATIVE_DTYPES or qweight.numel() != out.numel() or not (
            qweight.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"widen_weights: {qweight.dtype} {tuple(qweight.shape)} into {out.dtype} "
                         f"{tuple(out.shape)}: needs contiguous int8/float8_e4m3fn into float32/bfloat16")
    return fn(qweight.data_ptr(), kind, out.data_ptr(), out.dtype == torch.bfloat16, qweight.numel(),
              torch.get_num_threads()) == 0


_scratch = threading.local()  # one tile buffer per thread and dtype, reused by every call


def _tile_buffer(dtype: torch.dtype, numel: int) -> torch.Tensor:
    buffers: dict[torch.dtype, torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def tiled_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor | None:
    """x [M, K] @ (qweight [N, K] * scale [N]).T -> [M, N] in `out_dtype` through torch's GEMM in x's dtype
    (float32 or bfloat16; others are computed in float32), one cache-sized tile of widened weights at a time.
    None when the native kernels are unavailable."""
    if not widen_available():
        return None
    _check(x, qweight, scale, qweight.dtype, "tiled_linear")
    compute = x.dtype if x.dtype in _NATIVE_DTYPES else torch.float32
    x = x.to(compute).contiguous()
    num_rows, in_features = x.shape
    out_features = qweight.shape[0]
    y = torch.empty(num_rows, out_features, dtype=out_dtype)
    rows = max(1, min(out_features, TILE_ELEMENTS // in_features))
    buf = _tile_buffer(compute, rows * in_features)
    for n0 in range(0, out_features, rows):
        n1 = min(n0 + rows, out_features)
        tile = buf[:(n1 - n0) * in_features].view(n1 - n0, in_features)
        widen_weights(qweight[n0:n1], tile)
        # The product in the GEMM's dtype, then the channel scales in float32 (promotion) and one rounding.
        torch.mul(torch.mm(x, tile.T), scale[n0:n1], out=y[:, n0:n1])
    return y


def bf16_gemm_available() -> bool:
    """Whether `bf16_gemm` runs here: the native library built for a CPU with AVX512_BF16."""
    fn = native_function("ember_bf16_gemm_available", [])
    return fn is not None and bool(fn())  # type: ignore[operator]


def bf16_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """x [M, K] bfloat16 @ (qweight [N, K] int8 or float8_e4m3fn * scale [N]).T -> [M, N] in `out_dtype`, with
    the weights widened exactly to bf16 a tile at a time and AVX512_BF16 dot products (float32 sums, one chain
    per output in k order: a row's result never depends on its batch). None where it cannot run (no
    AVX512_BF16, or x not bfloat16: rounding float32 activations to bf16 would change the map)."""
    return _widened_gemm("bf16_gemm", "ember_bf16_gemm", bf16_gemm_available, x, qweight, scale, out_dtype)


def amx_available() -> bool:
    """Whether `amx_gemm` runs here: the native library built for a CPU with AMX-BF16, and the OS granting this
    process the tile registers."""
    fn = native_function("ember_amx_available", [])
    return fn is not None and bool(fn())  # type: ignore[operator]


def amx_int8_available() -> bool:
    """Whether `int8_gemm` runs its GEMM on the tile unit (TDPBSSD, amx_gemm.c): a library built for a CPU with
    AMX-INT8, and the OS granting this process the tile registers."""
    fn = native_function("ember_amx_int8_available", [])
    return fn is not None and bool(fn())  # type: ignore[operator]


def amx_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """`bf16_gemm`'s map (bf16 x, int8 or float8_e4m3fn weights widened exactly, float32 sums, a row's result
    independent of its batch) on the AMX tile unit: weights widened a block at a time into the tile layout, x
    copied once into padded rows. None where it cannot run (no AMX, or x not bfloat16)."""
    return _widened_gemm("amx_gemm", "ember_amx_gemm", amx_available, x, qweight, scale, out_dtype)


def _widened_gemm(name: str, symbol: str, available: Callable[[], bool], x: torch.Tensor, qweight: torch.Tensor,
                  scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The call both bf16 kernels share (same arguments, same map): None where `available` says no or x is not
    bfloat16 (rounding float32 activations to bf16 would change the map), or where the kernel refuses."""
    if x.dtype != torch.bfloat16 or not available():
        return None
    kind = _KINDS.get(qweight.dtype)
    if kind is None:
        raise ValueError(f"{name} needs int8 or float8_e4m3fn weights, got {qweight.dtype}")
    _check(x, qweight, scale, qweight.dtype, name)
    fn = native_function(symbol, _BF16_GEMM_ARGTYPES)
    x = x.contiguous()
    kernel_dtype = out_dtype if out_dtype in _NATIVE_DTYPES else torch.float32
    y = torch.empty(x.shape[0], qweight.shape[0], dtype=kernel_dtype)
    if x.shape[0] == 0:
        return y.to(out_dtype)
    rc = fn(x.data_ptr(), qweight.data_ptr(), kind, scale.data_ptr(), y.data_ptr(),  # type: ignore[misc]
            kernel_dtype == torch.bfloat16, x.shape[0], qweight.shape[0], qweight.shape[1], torch.get_num_threads())
    if rc != 0:
        return None
    return y if kernel_dtype == out_dtype else y.to(out_dtype)


def int8_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] @ (qweight [N, K] int8 * scale [N]).T -> [M, N] in `out_dtype` with x quantized per row to int8
    (symmetric, max|x| / 127: a row's numbers never depend on its batch) and an exact int32 GEMM. The native
    passes around the GEMM where available, else the same formula in torch ops (`int8_gemm_reference`)."""
    _check(x, qweight, scale, torch.int8, "int8_gemm")
    quantize = native_function("ember_quantize_rows_int8", _QUANTIZE_ROWS_ARGTYPES)
    rescale = native_function("ember_scale_int32", _SCALE_ARGTYPES)
    if quantize is None or rescale is None or x.dtype not in _NATIVE_DTYPES:
        return int8_gemm_reference(x, qweight, scale).to(out_dtype)
    x = x.contiguous()
    num_rows, in_features = x.shape
    threads = torch.get_num_threads()
    xq = torch.empty(num_rows, in_features, dtype=torch.int8)
    row_scale = torch.empty(num_rows, dtype=torch.float32)
    quantize(x.data_ptr(), x.dtype == torch.bfloat16, xq.data_ptr(), row_scale.data_ptr(), num_rows, in_features,
             threads)  # type: ignore[operator]
    kernel_dtype = out_dtype if out_dtype in _NATIVE_DTYPES else torch.float32
    y = torch.empty(num_rows, qweight.shape[0], dtype=kernel_dtype)
    if amx_int8_available():  # the same sums on the tile unit, scaled in the same order as it writes them
        amx = native_function("ember_amx_int8_gemm", _AMX_INT8_ARGTYPES)
        rc = amx(xq.data_ptr(), row_scale.data_ptr(), qweight.data_ptr(), scale.data_ptr(),  # type: ignore[misc]
                 y.data_ptr(), kernel_dtype == torch.bfloat16, num_rows, qweight.shape[0], in_features, threads)
        if rc == 0:
            return y if kernel_dtype == out_dtype else y.to(out_dtype)
    acc = torch._int_mm(xq, qweight.t())
    rescale(acc.data_ptr(), row_scale.data_ptr(), scale.data_ptr(), y.data_ptr(),  # type: ignore[operator]
            kernel_dtype == torch.bfloat16, num_rows, qweight.shape[0], threads)
    return y if kernel_dtype == out_dtype else y.to(out_dtype)


def int8_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_gemm` in torch ops, float32 out: the formula the native passes follow, rounding for rounding."""
    xf = x.float()
    row_scale = xf.abs().amax(dim=-1, keepdim=True).div_(127.0).clamp_min_(torch.finfo(torch.float32).tiny)
    xq = torch.round(xf / row_scale).to(torch.int8)  # |x / scale| <= 127 by construction
    return torch._int_mm(xq, qweight.t()).float().mul_(row_scale).mul_(scale)


def _check(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if qweight.dtype != dtype or scale.dtype != torch.float32 or not (qweight.is_contiguous()
                                                                       and scale.is_contiguous()):
        raise ValueError(f"{name} needs a contiguous {dtype} weight and contiguous float32 scales, got "
                         f"{qweight.dtype} and {scale.dtype}")
    if x.dim() != 2 or qweight.shape[1] != x.shape[1] or scale.shape != (qweight.shape[0],):
        raise ValueError(f"{name}: x {tuple(x.shape)}, weight {tuple(qweight.shape)} and scale "
                         f"{tuple(scale.shape)} do not fit")


def quantized_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same map in torch ops (float32), for int8 or float8_e4m3fn weights, to test the kernels against."""
    return x.float() @ (qweight.float() * scale.float()[:, None]).T
