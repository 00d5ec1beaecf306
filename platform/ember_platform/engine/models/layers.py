"""Building blocks shared by the model families: norms, linears that know how to load, activations.

Every parameter may carry a `weight_loader(param, tensor, shard_id=None)` attribute: the generic
checkpoint loader hands each checkpoint tensor to the loader of the parameter it maps to, so
packed parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj, stacked experts) fill themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ember_platform.engine.native import dense_linear, fused_ops, tracks_grad

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

    Normalizes in float32 and multiplies by the weight after casting back, as transformers does.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, D]. On the CPU one native call does the ~10 small ops below (same roundings):
        # at decode those ops cost more than the norm's arithmetic, 25 times a step.
        if (fused := fused_ops()) is not None and not tracks_grad(x, residual, self.weight):
            done = fused.rms_norm(x, self.weight, self.eps, residual)
            if done is not None:
                return done
        if residual is not None:
            x = x + residual
        residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype), residual


class Linear(nn.Linear):
    """y = x W^T (+ b), W: [out_features, in_features], loaded whole from one checkpoint tensor.

    An `nn.Linear`, so that quantizers (which replace `nn.Linear` layers after loading) find it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)  # on the meta device: no memory, no init cost
        for param in self.parameters(recurse=False):
            param.requires_grad_(False)
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Decode and speculative verification run a few rows; there MKL's float32 GEMM costs 2-4x its
        # one-row GEMV per row on AVX2 CPUs, while the native kernel streams the weights once for all
        # rows. It also sums each row in one fixed order whatever the row count, so a row's output does
        # not depend on the rows sharing its step (drafts verified, sequences batched). Else F.linear.
        weight = self.weight
        if (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.is_cpu and weight.is_cpu
                and 0 < x.numel() <= NATIVE_LINEAR_MAX_ROWS * self.in_features and x.shape[-1] == self.in_features
                and weight.is_contiguous() and not tracks_grad(x, weight)
                and (native := dense_linear()) is not None):
            return native(x.reshape(-1, self.in_features), weight, self.bias).view(*x.shape[:-1], self.out_features)
        return F.linear(x, weight, self.bias)


# The most rows the native CPU kernel takes: per row it costs about what one row does (it is bound by
# the weights' bytes at 1 row, by FMAs beyond), while MKL's GEMM gains on it with more rows; they were
# about even at 16 rows on tiny-llama's lm_head (4096x256) on an AVX2 EPYC, the native kernel 1.1-3x
# faster below that. Prefill chunks go to MKL.
NATIVE_LINEAR_MAX_ROWS = 16
class PackedLinear(Linear):
    """Several linears over the same input fused into one matmul, e.g. q/k/v or gate/up.

    `shards` maps each checkpoint shard id to its output size, in output order; the checkpoint's
    separate tensors are copied into their rows of the fused weight (and bias). Callers split the
    output by sizes they keep themselves: a quantizer may replace this layer after loading.
    """

    def __init__(self, in_features: int, shards: Mapping[Hashable, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up for a fused [..., 2 * I] projection (gate first, as checkpoints pack it)."""
    if (fused := fused_ops()) is not None and not tracks_grad(gate_up):
        out = fused.silu_and_mul(gate_up)
        if out is not None:
            return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

