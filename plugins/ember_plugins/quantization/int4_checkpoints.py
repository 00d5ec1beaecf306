"""Checkpoints already quantized to 4 bits, loaded straight into the `int4` layers and kernels (no full-precision
copy): the stored integers become `Int4Weights` as they are, and `Int4Method.install` repacks them for the kernel.

* GPTQ (AutoGPTQ / GPTQModel, `quant_method: "gptq"`, see `gptq.py` for the layout): `qweight` [in / 8, out]
  (eight values down the input dimension), `qzeros` [groups, out / 8] stored minus one, `scales` [groups, out],
  `g_idx` [in]. groups = ceil(in / group_size) (group_size -1: one group). With act-order (`desc_act`) g_idx is
  not in input order: the inputs are sorted by group once, and each forward pass reads the activations in that
  order (`input_order`), so the groups are contiguous for the kernel.
* compressed-tensors `pack-quantized` 4-bit (`num_bits: 4`, strategy "group" or "channel"): `weight_packed`
  int32 [out, ceil(in / 8)], eight values along the input, each stored + 8 (unsigned), the first in the lowest
  bits; `weight_scale` [out, groups]; `weight_zero_point` (asymmetric only: int4 values + 8, packed eight to
  an int32 down the output dimension, [ceil(out / 8), groups]); `weight_shape` [2]. W = scale * (q - zero) in
  signed values, which is the same in the stored unsigned ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ember_platform.api import Linear, QuantizationError, copy_shard
from ember_plugins.quantization.gptq import PACK, unpack_columns, unpack_rows
from ember_plugins.quantization.int4 import Int4Method, Int4Weights

OFFSET = 8  # compressed-tensors stores a signed int4 value v as v + 8


class GPTQInt4Method(Int4Method):
    """A GPTQ 4-bit layer (see the module docstring), loaded into the int4 kernels."""

    def __init__(self, group_size: int, kernel: str = "auto") -> None:
        super().__init__(kernel)
        self.group_size = group_size  # -1: one group per output row

    def size(self, layer: Linear) -> int:
        return layer.in_features if self.group_size <= 0 else self.group_size

    def create_weights(self, layer: Linear) -> None:
        if layer.in_features % PACK or any(s % PACK for s in layer.shard_sizes.values()):
            raise QuantizationError(f"gptq: a layer of {layer.in_features} inputs and outputs "
                                    f"{list(layer.shard_sizes.values())} does not pack {PACK} values to an int32")
        groups = -(-layer.in_features // self.size(layer))
        layer.add_weight("qweight", (layer.in_features // PACK, layer.out_features), torch.int32, output_dim=1)
        layer.add_weight("qzeros", (groups, layer.out_features // PACK), torch.int32, output_dim=1, pack_factor=PACK)
        layer.add_weight("scales", (groups, layer.out_features), torch.float32, output_dim=1)
        layer.add_weight("g_idx", (layer.in_features,), torch.int32, output_dim=None)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Any) -> None:
        if name == "g_idx" and getattr(layer, "_g_idx_loaded", False):
            if not torch.equal(param.data, loaded.to(param.dtype)):  # fused q/k/v share one input order
                raise ValueError("the shards of this fused layer have different g_idx (act-order orders each "
                                 "projection's inputs its own way); one fused layer needs one order")
            return
        copy_shard(layer, param, loaded.to(param.dtype), shard_id)
        if name == "g_idx":
            layer._g_idx_loaded = True

    def after_loading(self, layer: Linear) -> None:
        size, k = self.size(layer), layer.in_features
        groups = -(-k // size)
        g_idx = layer.g_idx.data.long()
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"gptq: g_idx names groups outside 0..{groups - 1}")
        values = unpack_rows(layer.qweight.data).T.to(torch.uint8)  # [out, in]
        zeros = (unpack_columns(layer.qzeros.data) + 1).T  # [out, groups]; the "gptq" format stores zero - 1
        scales = layer.scales.data.float().T
        order = None
        if not torch.equal(g_idx, torch.arange(k) // size):
            # Act-order: sort the inputs by group (stably); then each group must be `size` contiguous inputs.
            order = torch.argsort(g_idx, stable=True)
            counts = torch.bincount(g_idx, minlength=groups)
            expected = torch.full((groups,), size, dtype=counts.dtype)
            expected[-1] = k - size * (groups - 1)
            if not torch.equal(counts, expected):
                raise ValueError(f"gptq: g_idx puts {counts.tolist()} inputs in its groups, not groups of {size}")
            values = values[:, order]
        # Zero points stay as stored: the "gptq" format's zero 0 wraps to 16, which its own kernels compute too.
        weights = Int4Weights(values.contiguous(), scales.contiguous(), zeros.to(torch.uint8).contiguous(), size)
        del layer._g_idx_loaded
        self.install(layer, weights, input_order=order)

    def describe(self, layer: Linear) -> str:
        return "gptq checkpoint, " + super().describe(layer)


def unpack_int4_columns(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """[rows, ceil(n / 8)] int32 -> [rows, n] 0..15: value i of each int32 is column 8 j + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = (packed[:, :, None] >> shifts) & 0xF
    return values.reshape(packed.shape[0], -1)[:, :columns].to(torch.uint8)


class CompressedTensorsInt4Method(Int4Method):
    """A compressed-tensors pack-quantized 4-bit layer (see the module docstring), into the int4 kernels."""

    def __init__(self, group_size: int | None, symmetric: bool, kernel: str = "auto") -> None:
        super().__init__(kernel)
        self.group_size, self.symmetric = group_size, symmetric  # None: strategy "channel", one group

    def size(self, layer: Linear) -> int:
        return layer.in_features if self.group_size is None else self.group_size

    def create_weights(self, layer: Linear) -> None:
        groups = -(-layer.in_features // self.size(layer))
        layer.add_weight("weight_packed", (layer.out_features, -(-layer.in_features // PACK)), torch.int32)
        layer.add_weight("weight_scale", (layer.out_features, groups), torch.float32)
        layer.add_weight("weight_shape", (2,), torch.int64, output_dim=None)
        if not self.symmetric:
            if any(s % PACK for s in layer.shard_sizes.values()):
                raise QuantizationError(f"compressed-tensors: zero points pack {PACK} outputs to an int32; the "
                                        f"outputs {list(layer.shard_sizes.values())} of this layer do not")
            layer.add_weight("weight_zero_point", (-(-layer.out_features // PACK), groups), torch.int32,
                             pack_factor=PACK)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Any) -> None:
        if name == "weight_shape":  # one per checkpoint shard ([rows of that shard, in]): check, keep the fused one
            rows = layer.shard_sizes[shard_id]
            if [int(v) for v in loaded.tolist()] != [rows, layer.in_features]:
                raise ValueError(f"weight_shape {loaded.tolist()} is not [{rows}, {layer.in_features}]")
            param.data.copy_(torch.tensor([layer.out_features, layer.in_features]))
            return
        copy_shard(layer, param, loaded.to(param.dtype), shard_id)

    def after_loading(self, layer: Linear) -> None:
        values = unpack_int4_columns(layer.weight_packed.data, layer.in_features)
        scales = layer.weight_scale.data.float()
        if self.symmetric:
            zeros = torch.full(scales.shape, OFFSET, dtype=torch.uint8)
        else:  # packed down the outputs: unpack the transpose
            zeros = unpack_int4_columns(layer.weight_zero_point.data.T.contiguous(), layer.out_features).T
        self.install(layer, Int4Weights(values, scales.contiguous(), zeros.contiguous(), self.size(layer)))

    def describe(self, layer: Linear) -> str:
        return "compressed-tensors checkpoint, " + super().describe(layer)
