"""Python side of `int4_linear.c`: packing into its layout, argument checks and the ctypes call, and the torch
reference of the same arithmetic (int8 activations per row and group, exact integer group sums)."""

from __future__ import annotations

import ctypes

import torch

from ember_kernels.cpu.build import native_function
from ember_kernels.cpu.threads import THREADS

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_LINEAR_ARGS = [_PTR, _INT, _PTR, _PTR, _PTR, _PTR, _INT, _I64, _I64, _I64, _I64, _INT]
_PACK_ARGS = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64]
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
ROW_BLOCK = 16  # output rows per block of the packed layout


def _linear() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native_function("ember_int4_linear", _LINEAR_ARGS)  # type: ignore[return-value]


def int4_linear_available() -> bool:
    return _linear() is not None


def groups_of(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def int4_pack(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """values [N, K] 0..15, scales and zeros [N, groups] -> (packed weights, scales, scales * zeros) in the
    kernel's layout (see int4_linear.c); None without the native library. group_size must be a multiple of 8."""
    fn = native_function("ember_int4_pack", _PACK_ARGS)
    if fn is None:
        return None
    n, k = values.shape
    groups = groups_of(k, group_size)
    if group_size % 8 or scales.shape != (n, groups) or zeros.shape != (n, groups):
        raise ValueError(f"int4_pack: values {tuple(values.shape)}, scales {tuple(scales.shape)}, zeros "
                         f"{tuple(zeros.shape)} and group {group_size} do not fit")
    values = values.to(torch.uint8).contiguous()
    scales, zeros = scales.float().contiguous(), zeros.float().contiguous()
    blocks = -(-n // ROW_BLOCK)
    packed = torch.empty(blocks, groups * group_size // 8 * 64, dtype=torch.uint8)
    sc = torch.empty(blocks, groups, ROW_BLOCK, dtype=torch.float32)
    sz = torch.empty_like(sc)
    rc = fn(values.data_ptr(), scales.data_ptr(), zeros.data_ptr(), packed.data_ptr(), sc.data_ptr(),
            sz.data_ptr(), n, k, group_size)
    if rc != 0:
        raise ValueError(f"int4_pack failed ({rc})")
    return packed, sc, sz


def _check_packed(name: str, x: torch.Tensor, packed: torch.Tensor, sc: torch.Tensor, sz: torch.Tensor,
                  out_features: int, group_size: int) -> None:
    """The packed layout (`int4_pack`) both int4 kernels read: refuse anything else before C reads past it."""
    groups = groups_of(x.shape[1], group_size)
    blocks = -(-out_features // ROW_BLOCK)
    if (packed.dtype != torch.uint8 or packed.shape != (blocks, groups * group_size // 8 * 64)
            or sc.shape != (blocks, groups, ROW_BLOCK) or sz.shape != sc.shape):
        raise ValueError(f"{name}: x {tuple(x.shape)} does not fit packed weights {tuple(packed.shape)}, "
                         f"scales {tuple(sc.shape)} for {out_features} outputs in groups of {group_size}")


def int4_linear(x: torch.Tensor, packed: torch.Tensor, sc: torch.Tensor, sz: torch.Tensor, out_features: int,
                group_size: int, out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """x [M, K] (CPU) @ the packed int4 weights [N = out_features, K] .T -> [M, N] in `out_dtype`; None if the
    library is unavailable. x is read as is when float32 or bfloat16 (else converted to float32)."""
    fn = _linear()
    if fn is None:
        return None
    num_rows, in_features = x.shape
    _check_packed("int4_linear", x, packed, sc, sz, out_features, group_size)
    if x.dtype not in _NATIVE_DTYPES:
        x = x.float()
    x = x.contiguous()
    kernel_dtype = out_dtype if out_dtype in _NATIVE_DTYPES else torch.float32
    out = torch.empty(num_rows, out_features, dtype=kernel_dtype)
    if num_rows == 0:
        return out.to(out_dtype)
    # Decode-sized calls on one thread or torch's, as measured for this shape (threads.py).
    rc = THREADS.run(("int4_linear", num_rows, out_features, in_features), num_rows, fn, x.data_ptr(),
                     x.dtype == torch.bfloat16, packed.data_ptr(), sc.data_ptr(), sz.data_ptr(), out.data_ptr(),
                     kernel_dtype == torch.bfloat16, num_rows, out_features, in_features, group_size)
    if rc != 0:
        return None
    return out if kernel_dtype == out_dtype else out.to(out_dtype)


def amx_int4_linear(x: torch.Tensor, packed: torch.Tensor, sc: torch.Tensor, sz: torch.Tensor, out_features: int,
                    group_size: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """The prefill path on AMX CPUs (amx_gemm.c): bf16 x [M, K] @ the packed int4 weights .T, the weights
    dequantized to bf16 (bf16(s q - s z)) a block at a time in the tile unit's layout, float32 sums. Weight-only
    (x is not quantized, unlike `int4_linear`), and a row's result never depends on its batch. None where it cannot
    run: x not bfloat16, or no AMX."""
    if x.dtype != torch.bfloat16:
        return None
    from ember_kernels.cpu.quantized_linear import amx_available

    fn = native_function("ember_amx_gemm_int4", [_PTR, _PTR, _PTR, _PTR, _PTR, _INT, _I64, _I64, _I64, _I64, _INT])
    if fn is None or not amx_available():
        return None
    num_rows, in_features = x.shape
    _check_packed("amx_int4_linear", x, packed, sc, sz, out_features, group_size)
    x = x.contiguous()
    kernel_dtype = out_dtype if out_dtype in _NATIVE_DTYPES else torch.float32
    out = torch.empty(num_rows, out_features, dtype=kernel_dtype)
    if num_rows == 0:
        return out.to(out_dtype)
    rc = fn(x.data_ptr(), packed.data_ptr(), sc.data_ptr(), sz.data_ptr(), out.data_ptr(),
            kernel_dtype == torch.bfloat16, num_rows, out_features, in_features, group_size, torch.get_num_threads())
    if rc != 0:
        return None
    return out if kernel_dtype == out_dtype else out.to(out_dtype)


def quantize_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: (xq [M, groups, G] integral float32, xs [M, groups])."""
    m, k = x.shape
    groups = groups_of(k, group_size)
    padded = torch.zeros(m, groups * group_size, dtype=torch.float32)
    padded[:, :k] = x.float()
    g = padded.view(m, groups, group_size)
    amax = g.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(g * inv[..., None]).clamp(-127, 127), amax / 127.0


def int4_linear_reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """The kernel's map in torch ops (float64 group sums: exact for these integers), float32 result."""
    n, k = values.shape
    xq, xs = quantize_activations(x, group_size)  # [M, g, G], [M, g]
    groups = xq.shape[1]
    q = torch.zeros(n, groups * group_size, dtype=torch.float64)
    q[:, :k] = values.double()
    dots = torch.einsum("mgk,ngk->mng", xq.double(), q.view(n, groups, group_size))  # [M, N, g]
    sums = xq.double().sum(-1)  # [M, g]
    exact = dots - zeros.double()[None] * sums[:, None, :]
    return (exact * scales.double()[None] * xs.double()[:, None, :]).sum(-1).float()
