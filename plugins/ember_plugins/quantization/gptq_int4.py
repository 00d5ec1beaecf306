"""gptq's 4-bit weights as a GPTQ checkpoint stores them (`qweight`, `qzeros` minus one, `scales`, `g_idx`; see
gptq.py): what the engine's cache and a package's quantized weights hold, loaded back by the checkpoint loader
(int4_checkpoints.GPTQInt4Method) into the int4 kernels, act-order included."""

from __future__ import annotations

import torch

from ember_plugins.quantization.gptq import PACK
from ember_plugins.quantization.gptq_quantize import QuantizedWeight


def _pack(values: torch.Tensor) -> torch.Tensor:
    """[..., n] 0..15 along the last dimension, n a multiple of 8 -> int32 [..., n / 8], value k of each int32 from
    position 8 j + k (AutoGPTQ's packing, the first value in the lowest bits)."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, PACK)
    packed = sum(v[..., k] << (4 * k) for k in range(PACK))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).contiguous()


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[n, m] -> [n / 8, m] int32: eight values down the rows (`qweight`; inverse of gptq.unpack_rows)."""
    return _pack(values.T).T.contiguous()


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """[g, m] -> [g, m / 8] int32: eight values along the columns (`qzeros`; inverse of gptq.unpack_columns)."""
    return _pack(values)


def gptq_tensors(result: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A 4-bit result in the GPTQ checkpoint layout. The "gptq" format stores zero points minus one, which cannot
    hold a zero of 0: the asymmetric grid never makes one (gptq_quantize.grid)."""
    assert result.bits == 4 and int(result.zeros.min()) >= 1, "the gptq format cannot store a zero point of 0"
    return {"qweight": pack_rows(result.q.T), "qzeros": pack_columns((result.zeros - 1).T),
            "scales": result.scales.T.float().contiguous(), "g_idx": result.g_idx.to(torch.int32)}
