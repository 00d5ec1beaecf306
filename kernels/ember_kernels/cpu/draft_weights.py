"""The native drafters' matrices as their kernels read them (draft_ops.h): float32, bfloat16, or int8 packed in
blocks of 16 outputs with a float32 scale per output. On a CPU with AVX512-VNNI the int8 linear rounds its inputs
to int8 too (W8A8, a scale per row: `packed_int8_activation_bits`, `round_rows_int8`)."""

from __future__ import annotations

import ctypes

import torch

from ember_kernels.cpu.build import native_function

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p

FORMATS = ("float32", "bfloat16", "int8")  # the kernels' FORMAT_* values, in order (draft_ops.h)
PACK = 16  # outputs per packed int8 block (draft_ops.h's PACK)


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float32 -> (int8 [ceil(N / PACK), K, PACK], float32 scales [ceil(N / PACK) * PACK]): symmetric, a
    scale per output row (max |w| / 127); the last block padded with zero rows and zero scales."""
    out_features, in_features = weight.shape
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
    values = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    blocks = -(-out_features // PACK)
    padded = torch.zeros(blocks * PACK, in_features, dtype=torch.int8)
    padded[:out_features] = values
    scales = torch.zeros(blocks * PACK, dtype=torch.float32)
    scales[:out_features] = scale
    return padded.view(blocks, PACK, in_features).transpose(1, 2).contiguous(), scales


def unpack_int8(packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float32 [N, K] matrix a packed one stands for (for tests and references)."""
    blocks, in_features, _ = packed.shape
    rows = packed.transpose(1, 2).reshape(blocks * PACK, in_features)[:out_features]
    return rows.float() * scales[:out_features, None]


def kept_matrix(owner: str, name: str, weight: torch.Tensor, weight_format: str,
                matrices: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight as the kernel reads it, and its scales (packed int8 matrices only); weights outside `matrices`
    (norms, embeddings) stay float32."""
    if weight.dtype != torch.float32 or not weight.is_cpu:
        raise ValueError(f"{owner}: weight {name} must be a float32 CPU tensor")
    if weight_format not in FORMATS:
        raise ValueError(f"{owner}: weight_format must be one of {FORMATS}, got {weight_format!r}")
    if name not in matrices or weight_format == "float32":
        return weight.contiguous(), None
    if weight_format == "bfloat16":
        return weight.to(torch.bfloat16).contiguous(), None
    return pack_int8(weight)


def _packed_linear_kernel() -> object | None:
    return native_function("ember_packed_int8_linear", [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int])


def packed_int8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int,
                       num_threads: int = 1) -> torch.Tensor | None:
    """x [M, K] float32 @ the packed matrix's float32 [N, K].T through the drafters' kernel (draft_ops.h): Medusa's
    native heads, and tests of the kernel on its own; None if the native library is unavailable."""
    fn = _packed_linear_kernel()
    if fn is None:
        return None
    x = x.float().contiguous()
    if packed.dtype != torch.int8 or packed.shape[1] != x.shape[1] or packed.shape[2] != PACK \
            or scales.shape != (packed.shape[0] * PACK,) or not 0 < out_features <= scales.shape[0]:
        raise ValueError(f"packed_int8_linear: x {tuple(x.shape)}, packed {tuple(packed.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit {out_features} outputs")
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    rc = fn(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(), x.shape[0], out_features, x.shape[1],
            num_threads)
    return out if rc == 0 else None


def packed_int8_available() -> bool:
    """Whether the drafters' packed int8 linear can run here (the native library built and loaded)."""
    return _packed_linear_kernel() is not None


def packed_int8_activation_bits() -> int | None:
    """8 where the drafters' packed int8 linear rounds its inputs to int8 (W8A8: AVX512-VNNI), 32 where it computes
    with them in float32; None if the native library is unavailable."""
    fn = native_function("ember_packed_int8_activation_bits", [])
    return None if fn is None else int(fn())


def round_rows_int8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 as the W8A8 kernel computes with it: each row rounded to int8 on its own scale (max |x| /
    127; to nearest, ties to even), as float32 (for tests and references)."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp(-127, 127)
    return q * (amax / 127)
