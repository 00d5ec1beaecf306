"""Building blocks shared by the model families: norms, linears that know how to load, embeddings.

Their arithmetic is the engine's kernel-op table (`KernelOps`, given at construction): a plugin's kernel where it
takes the inputs, else plain torch. Every parameter may carry a `weight_loader(param, tensor, shard_id=None)`
attribute: the generic checkpoint loader hands each checkpoint tensor to the loader of the parameter it maps to,
so packed parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj, stacked experts) fill themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ember_platform.engine.kernel_ops import KernelOps

WeightLoader = Callable[..., None]


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    """Copy a whole checkpoint tensor into `param` (casting to its dtype and device)."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not packed, but a shard ({shard_id!r}) was given for it")
    copy_weight(param.data, loaded)


def copy_weight(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into `target` (a parameter or a slice of one) after checking its shape."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: the model expects {tuple(target.shape)}, "
                         f"the checkpoint has {tuple(loaded.shape)}")
    target.copy_(loaded)


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


class Linear(nn.Linear):
    """y = x W^T (+ b), W: [out_features, in_features], loaded whole from one checkpoint tensor.

    An `nn.Linear`, so that quantizers (which replace `nn.Linear` layers after loading) find it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, ops: KernelOps) -> None:
        super().__init__(in_features, out_features, bias=bias)  # on the meta device: no memory, no init cost
        self.ops = ops
        for param in self.parameters(recurse=False):
            param.requires_grad_(False)
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The `linear` kernel op: decode and speculative verification run a few rows, where a kernel that
        # streams the weights once for all rows beats a GEMM library (prefill-sized inputs go to F.linear).
        return self.ops.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several linears over the same input fused into one matmul, e.g. q/k/v or gate/up.

    `shards` maps each checkpoint shard id to its output size, in output order; the checkpoint's
    separate tensors are copied into their rows of the fused weight (and bias). Callers split the
    output by sizes they keep themselves: a quantizer may replace this layer after loading.
    """

    def __init__(self, in_features: int, shards: Mapping[Hashable, int], bias: bool = False, *,
                 ops: KernelOps) -> None:
        super().__init__(in_features, sum(shards.values()), bias, ops=ops)
        self.shard_sizes = dict(shards)
        self.shard_offsets: dict[Hashable, int] = {}
        offset = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = offset
            offset += size

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            copy_weight(param.data, loaded)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; this layer packs {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id], self.shard_sizes[shard_id]
        copy_weight(param.data.narrow(0, offset, size), loaded)


class Embedding(nn.Module):
    """Token embeddings, weight: [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = new_parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

