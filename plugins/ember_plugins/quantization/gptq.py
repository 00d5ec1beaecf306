"""`gptq`: checkpoints quantized to 4 bits by GPTQ (AutoGPTQ / GPTQModel's layout, what transformers loads with
`quant_method: "gptq"`), loaded into the int4 layers and kernels (`int4_checkpoints.GPTQInt4Method`), or, with
`kernel = "reference"`, kept as stored and run by a plain-torch dequantize-then-matmul (`GPTQLinearMethod`).

Per linear (weights in [in, out] orientation): `qweight` int32 [in / 8, out], eight 4-bit values down the input
dimension, the first in the lowest bits; `qzeros` int32 [groups, out / 8], eight zero points along the output
dimension, stored minus one (the "gptq" checkpoint format); `scales` [groups, out]; `g_idx` int32 [in], the group
of each input row. W[r, c] = scales[g, c] * (q[r, c] - (qzeros[g, c] + 1)) with g = g_idx[r].

The reference keeps the weights packed (half a byte each); each forward pass dequantizes the layer in the
activations' dtype and runs one matmul: correct everywhere torch runs, not fast. Act-order (`desc_act`, a g_idx
not in input order) loads either way. Refused as not supported yet: other bit widths, the "gptq_v2" zero-point
format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ember_platform.api import (
    UNQUANTIZED,
    CalibrationContext,
    Linear,
    LinearMethod,
    LinearSpec,
    QuantizationContext,
    QuantizationError,
    Quantizer,
    copy_shard,
)
from ember_plugins.quantization.options import check_gptq, checked

BITS = 4
PACK = 32 // BITS  # 4-bit values per int32


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[n / 8, m] int32 -> [n, m] values 0..15 (int16): value k of each int32 is the row 8 i + k."""
    shifts = torch.arange(0, 32, BITS, device=packed.device, dtype=torch.int32)  # [8]
    values = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [n / 8, 8, m]
    return values.reshape(-1, packed.shape[1]).to(torch.int16)


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """[g, m / 8] int32 -> [g, m] values 0..15 (int16): value k of each int32 is the column 8 j + k."""
    shifts = torch.arange(0, 32, BITS, device=packed.device, dtype=torch.int32)
    values = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [g, m / 8, 8]
    return values.reshape(packed.shape[0], -1).to(torch.int16)


class GPTQLinearMethod(LinearMethod):
    """4-bit GPTQ weights, dequantized per forward pass (see the module docstring for the layout)."""

    full_precision_until_loaded = False

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def groups(self, layer: Linear) -> int:
        return 1 if self.group_size <= 0 else layer.in_features // self.group_size

    def create_weights(self, layer: Linear) -> None:
        size = layer.in_features if self.group_size <= 0 else self.group_size
        if layer.in_features % PACK or layer.in_features % size or any(s % PACK for s in layer.shard_sizes.values()):
            raise QuantizationError(f"gptq: a layer of {layer.in_features} inputs and outputs "
                                    f"{list(layer.shard_sizes.values())} does not split into groups of {size} and "
                                    f"packs of {PACK}")
        groups = self.groups(layer)
        layer.add_weight("qweight", (layer.in_features // PACK, layer.out_features), torch.int32, output_dim=1)
        layer.add_weight("qzeros", (groups, layer.out_features // PACK), torch.int32, output_dim=1, pack_factor=PACK)
        layer.add_weight("scales", (groups, layer.out_features), None, output_dim=1)
        layer.add_weight("g_idx", (layer.in_features,), torch.int32, output_dim=None)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Any) -> None:
        if name == "g_idx" and getattr(layer, "_g_idx_loaded", False):
            if not torch.equal(param.data, loaded.to(param.dtype)):  # fused q/k/v must share one input grouping
                raise ValueError("the shards of this fused layer have different g_idx (act-order): not supported yet")
            return
        copy_shard(layer, param, loaded, shard_id)
        if name == "g_idx":
            layer._g_idx_loaded = True

    def after_loading(self, layer: Linear) -> None:
        layer.g_idx = nn.Parameter(layer.g_idx.data.long(), requires_grad=False)  # an index from here on
        if int(layer.g_idx.min()) < 0 or int(layer.g_idx.max()) >= self.groups(layer):
            raise ValueError(f"gptq: g_idx names groups outside 0..{self.groups(layer) - 1}")

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] in `dtype`."""
        q = unpack_rows(layer.qweight)  # [in, out]
        zeros = unpack_columns(layer.qzeros) + 1  # [groups, out]
        g = layer.g_idx
        w = (q - zeros[g]).to(dtype) * layer.scales.to(dtype)[g]  # [in, out]
        return w.T

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantized(layer, x.dtype), bias)

    def describe(self, layer: Linear) -> str:
        return f"gptq {BITS}-bit, group {self.group_size}, torch dequant-matmul"


class GPTQQuantizer(Quantizer):
    """A GPTQ checkpoint (config.json quantization_config) loads as it is stored: every linear but the LM head
    (unless the config's `lm_head`); its one option, `kernel`: an int4 kernel (auto, native, int4pack, triton,
    dequant) or "reference". A full-precision checkpoint is calibrated and quantized by GPTQ here
    (gptq_calibrated.py: its options, int4 or int8 layers)."""

    checkpoint_format = "gptq"

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.method: LinearMethod | None = None
        self.lm_head = False
        self.settings = checked(check_gptq, self.options)  # checked before any weight loads (and by ember, options.py)
        self.calibrated: Any = None  # a gptq_calibrated.GPTQ, for a full-precision checkpoint

    def prepare(self, context: QuantizationContext) -> None:
        config = context.checkpoint_quantization
        if config is None:  # full precision: quantize it here, from calibration text
            from ember_plugins.quantization.gptq_calibrated import GPTQ

            self.calibrated = GPTQ(self.settings, context)
            self.needs_calibration = True
            return
        if config.get("quant_method") != "gptq":
            raise QuantizationError("quantization 'gptq' loads GPTQ checkpoints (config.json quantization_config."
                                    f"quant_method = \"gptq\") or quantizes full-precision ones; this checkpoint is "
                                    f"quantized by {config.get('quant_method')!r}")
        stray = sorted(set(self.options) - {"kernel"})
        if stray:
            raise QuantizationError(f"quantization.options.{stray[0]}: this checkpoint is already quantized by GPTQ "
                                    "(config.json quantization_config); only `kernel` applies to it, the other "
                                    "options to quantizing full-precision weights")
        if context.position != len(context.chain) - 1:
            raise QuantizationError("quantization 'gptq' loads stored 4-bit weights, so it must come last")
        unsupported = [(k, v, ok) for k, v, ok in (
            ("bits", config.get("bits"), config.get("bits") == BITS),
            ("checkpoint_format", config.get("checkpoint_format"), config.get("checkpoint_format", "gptq") == "gptq"),
        ) if not ok]
        if unsupported:
            key, value, _ = unsupported[0]
            raise QuantizationError(f"not supported yet: GPTQ quantization_config.{key} = {value!r} (supported: "
                                    "bits 4, checkpoint_format \"gptq\")")
        self.lm_head = bool(config.get("lm_head", False))
        self.method = self.checkpoint_method(config)

    def checkpoint_method(self, config: Mapping[str, Any]) -> LinearMethod:
        """The layers of a GPTQ checkpoint: the int4 kernels, or the torch reference (`kernel = "reference"`)."""
        group_size = int(config.get("group_size", 128))
        kernel = str(self.options.get("kernel", "auto"))
        if kernel == "reference":
            return GPTQLinearMethod(group_size)
        from ember_plugins.quantization.int4_checkpoints import GPTQInt4Method  # it imports this module

        return GPTQInt4Method(group_size, kernel)

    def linear_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        if self.calibrated is not None:
            return self.calibrated.linear_method(spec, inner)
        assert self.method is not None, "prepare() first"
        if inner is not UNQUANTIZED:
            raise QuantizationError("quantization 'gptq' must be the last method")
        if spec.kind == "lm_head" and not self.lm_head:
            return inner
        return self.method

    def restored_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod | None:
        """What quantizing made (int4 or int8 layers), loaded back; None for a GPTQ checkpoint (loading it
        costs nothing to cache)."""
        return None if self.calibrated is None else self.calibrated.restored_method(spec, inner)

    def calibrate(self, calibration: CalibrationContext) -> None:
        self.calibrated.calibrate(calibration)
