"""`int8`: weight-only quantization, one scale per output channel.

Decode at small batch is bound by reading weights, so halving (vs bf16) or quartering (vs
fp32) the bytes read is the whole win: `torch._weight_int8pack_mm` reads int8 weights and
scales them on the fly. For large batches (prefill) compute dominates instead, and that kernel
is slower than a dense GEMM, so we dequantize the layer's weights and use the dense path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ember_platform.engine.quantization import Quantizer, linear_layers


class Int8Linear(nn.Module):
    """y = x @ (w_int8 * scale).T + bias, with w_int8: [out, in] int8 and scale: [out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype,
                 dense_threshold: int) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # [out]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        # The int8 kernel is fast with bf16 activations on CPU; fp32 activations take a slow path.
        self.compute_dtype = torch.bfloat16 if compute_dtype == torch.float32 else compute_dtype
        self.register_buffer("scale", scale.to(self.compute_dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dense_threshold = dense_threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in]
        shape, out_dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.dense_threshold:
            y = torch._weight_int8pack_mm(x2.to(self.compute_dtype).contiguous(), self.qweight, self.scale)
        else:
            dense = self.qweight.to(out_dtype) * self.scale.to(out_dtype)[:, None]
            y = x2 @ dense.T
        y = y.to(out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel"


class Int8Quantizer(Quantizer):
    """Options: `skip` (module names kept in full precision, default ["lm_head"]),
    `dense_threshold` (rows above which the dequantized dense path is used, default 32)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.skip = tuple(self.options.get("skip", ("lm_head",)))
        self.dense_threshold = int(self.options.get("dense_threshold", 32))

    def quantize(self, model: nn.Module) -> nn.Module:
        for parent, name, layer in list(linear_layers(model, self.skip)):
            setattr(parent, name, Int8Linear(layer.weight, layer.bias, layer.weight.dtype, self.dense_threshold))
        return model
