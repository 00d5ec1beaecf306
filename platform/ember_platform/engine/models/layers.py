"""Building blocks shared by the model families: norms, linears that know how to load, embeddings.

Their arithmetic is the engine's kernel-op table (`KernelOps`, given at construction): a plugin's kernel where it
takes the inputs, else plain torch. Every parameter may carry a `weight_loader(param, tensor, shard_id=None)`
attribute: the generic checkpoint loader hands each checkpoint tensor to the loader of the parameter it maps to,
so packed parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj, stacked experts) fill themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ember_platform.engine.linear_method import Linear
from ember_platform.engine.linear_method import copy_into as copy_weight

if TYPE_CHECKING:
    from ember_platform.engine.kernel_ops import KernelOps

WeightLoader = Callable[..., None]


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    """Copy a whole checkpoint tensor into `param` (casting to its dtype and device)."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not packed, but a shard ({shard_id!r}) was given for it")
    copy_weight(param.data, loaded)


def new_parameter(*shape: int, weight_loader: WeightLoader = default_weight_loader) -> nn.Parameter:
    """An uninitialized parameter (built on the meta device; the loader materializes and fills it)."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: `norm(x, residual)` returns (normed, x + residual).

    Normalizes in float32 and multiplies by the weight after casting back, as transformers does (the
    `rms_norm` kernel op: at decode its ~10 small torch ops cost more than the arithmetic, 25 times a step).
    """

    def __init__(self, hidden_size: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = new_parameter(hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, D]
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


# One linear layer class for every family: its weights are its LinearMethod's (full precision, or a quantizer's
# int8 / pre-quantized layout), chosen per layer before loading. A packed linear is the same class given a
# {shard id: size} mapping for its outputs (q/k/v -> qkv_proj, gate/up -> gate_up_proj).
PackedLinear = Linear


class Embedding(nn.Module):
    """Token embeddings, weight: [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = new_parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

