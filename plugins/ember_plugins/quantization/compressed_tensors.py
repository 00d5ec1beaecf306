"""`compressed-tensors`: checkpoints that llm-compressor (or anything writing the compressed-tensors format) already
quantized to int8, loaded directly into the int8 kernels: no full-precision copy is ever made.

Read from config.json's `quantization_config` (`quant_method: "compressed-tensors"`): int8 weights, symmetric,
one scale per output channel (`strategy: "channel"`), stored as `weight` int8 (`format: "int-quantized"`) or
four to an int32 (`weight_packed` + `weight_shape`, `format: "pack-quantized"`), with `weight_scale` [out, 1].
Layers in `ignore` (names, or "re:" regular expressions, of the checkpoint's modules) load in full precision.
4-bit `pack-quantized` weights (strategy "group" or "channel", symmetric or not) load into the int4 kernels
(`int4_checkpoints.CompressedTensorsInt4Method`). fp8 (`format: "float-quantized"`: `weight` float8_e4m3fn, one
`weight_scale` per channel [out, 1] or per tensor) loads into the fp8 layers (`fp8.Fp8LinearMethod`): weight-only,
or W8A8 where the checkpoint quantizes activations too (dynamic per token, or static per tensor with an
`input_scale`), which needs a GPU of compute capability >= 8.9; elsewhere option `activations = "none"` runs its
fp8 weights with full-precision activations, and without it the load is refused, saying so. Anything else in the
format (int8 activation quantization, int8 groups, act-order, sparsity, a quantized KV cache) is refused with what is
not supported yet, rather than loaded wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ember_platform.api import (
    UNQUANTIZED,
    Linear,
    LinearMethod,
    LinearSpec,
    QuantizationContext,
    QuantizationError,
    Quantizer,
    copy_shard,
)
from ember_plugins.quantization.int8 import Int8LinearMethod

FORMATS = ("int-quantized", "pack-quantized", "float-quantized")
PACK_FACTOR = 4  # int8 values per int32 in pack-quantized


def unpack_int8(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """[out, ceil(in / 4)] int32 -> [out, in] int8. compressed-tensors' `pack_to_int32` stores each value + 128
    (unsigned) in 8 bits, the first of every four in the lowest byte."""
    parts = [(packed >> (8 * i)) & 0xFF for i in range(PACK_FACTOR)]  # [out, n] each
    unsigned = torch.stack(parts, dim=-1).reshape(packed.shape[0], -1)[:, :in_features]
    return (unsigned - 128).to(torch.int8)


class PackedInt8LinearMethod(Int8LinearMethod):
    """int8 weights packed four to an int32 (`weight_packed`, `weight_shape`): unpacked once loaded."""

    def create_weights(self, layer: Linear) -> None:
        packed_in = -(-layer.in_features // PACK_FACTOR)
        layer.add_weight("weight_packed", (layer.out_features, packed_in), torch.int32)
        layer.add_weight("weight_scale", (layer.out_features,), torch.float32)
        layer.add_weight("weight_shape", (2,), torch.int64, output_dim=None)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Any) -> None:
        if name == "weight_shape":  # one per checkpoint shard ([rows of that shard, in]): check, keep the fused one
            rows = layer.shard_sizes[shard_id]
            if [int(v) for v in loaded.tolist()] != [rows, layer.in_features]:
                raise ValueError(f"weight_shape {loaded.tolist()} is not [{rows}, {layer.in_features}]")
            param.data.copy_(torch.tensor([layer.out_features, layer.in_features]))
            return
        if name == "weight_scale" and loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]
        copy_shard(layer, param, loaded, shard_id)

    def after_loading(self, layer: Linear) -> None:
        qweight = unpack_int8(layer.weight_packed.data, layer.in_features)
        del layer.weight_packed, layer.weight_shape
        layer.weight = nn.Parameter(qweight, requires_grad=False)
        super().after_loading(layer)


def int4_method(weights: Mapping[str, Any], where: str, fmt: str, options: Mapping[str, Any]) -> LinearMethod:
    """The method of a 4-bit scheme: pack-quantized int weights in groups or per channel, into the int4 kernels."""
    from ember_plugins.quantization.int4_checkpoints import CompressedTensorsInt4Method

    if fmt != "pack-quantized":
        raise QuantizationError(f"not supported yet: compressed-tensors 4-bit weights in format {fmt!r} "
                                "(supported: pack-quantized)")
    strategy = weights.get("strategy")
    checks = (("type", weights.get("type") == "int", "'int'"),
              ("strategy", strategy in ("group", "channel"), "'group' or 'channel'"),
              ("group_size", strategy != "group" or (isinstance(weights.get("group_size"), int)
               and weights["group_size"] > 0), "a positive integer with strategy 'group'"),
              ("dynamic", not weights.get("dynamic"), "false"),
              ("actorder", weights.get("actorder") in (None, False), "none"))
    for key, ok, supported in checks:
        if not ok:
            raise QuantizationError(f"not supported yet: {where}.weights.{key} = {weights.get(key)!r} with "
                                    f"num_bits 4 (supported: {supported})")
    unread = sorted(set(options) - {"kernel"})
    if unread:
        raise QuantizationError(f"quantization.options.{unread[0]}: a 4-bit compressed-tensors checkpoint reads "
                                "only kernel")
    group_size = int(weights["group_size"]) if strategy == "group" else None
    return CompressedTensorsInt4Method(group_size, bool(weights.get("symmetric", True)),
                                       str(options.get("kernel", "auto")))


def fp8_method(group: Mapping[str, Any], where: str, fmt: str, options: Mapping[str, Any]) -> LinearMethod:
    """The fp8 layers' method for a float-quantized group (FP8 and FP8_DYNAMIC schemes, or weight-only)."""
    from ember_plugins.quantization.fp8 import Fp8LinearMethod, check_w8a8_device

    if fmt != "float-quantized":
        raise QuantizationError(f"not supported yet: compressed-tensors fp8 weights in format {fmt!r} "
                                "(supported: float-quantized)")
    weights = group.get("weights") or {}
    wanted = {"num_bits": 8, "type": "float", "symmetric": True}
    for key, value in wanted.items():
        if weights.get(key) != value:
            raise QuantizationError(f"not supported yet: {where}.weights.{key} = {weights.get(key)!r} "
                                    f"(supported: {value!r})")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise QuantizationError(f"not supported yet: {where}.weights.strategy = {weights.get('strategy')!r} for "
                                "fp8 (supported: 'channel', 'tensor')")
    if weights.get("dynamic") or weights.get("group_size") is not None:
        raise QuantizationError(f"not supported yet: {where}.weights with dynamic or group_size")
    if group.get("output_activations"):
        raise QuantizationError(f"not supported yet: {where}.output_activations")
    acts = group.get("input_activations")
    static = False
    if acts:
        for key, value in wanted.items():
            if acts.get(key) != value:
                raise QuantizationError(f"not supported yet: {where}.input_activations.{key} = {acts.get(key)!r} "
                                        f"(supported: {value!r})")
        scheme = (acts.get("strategy"), bool(acts.get("dynamic")))
        if scheme not in (("token", True), ("tensor", False)):
            raise QuantizationError(f"not supported yet: {where}.input_activations with strategy "
                                    f"{scheme[0]!r}, dynamic {scheme[1]} (supported: per token dynamic, per tensor "
                                    "static)")
        static = scheme == ("tensor", False)
    activations = str(options.get("activations", "fp8" if acts else "none"))
    if activations == "fp8" and not torch.cuda.is_available():
        try:
            check_w8a8_device(torch.device("cpu"))
        except QuantizationError as e:
            said = f"{where}.input_activations: the checkpoint quantizes activations to fp8" if acts else str(e)
            raise QuantizationError(f"{said} (W8A8, through torch._scaled_mm), which needs a CUDA GPU of compute "
                                    "capability >= 8.9, and this machine has none: set [quantization] method = "
                                    "\"compressed-tensors\" with quantization.options.activations = \"none\" to run "
                                    "its fp8 weights with full-precision activations") from None
    threshold = options.get("dense_threshold")
    return Fp8LinearMethod(str(options.get("kernel", "auto")), None if threshold is None else int(threshold),
                           activations, prequantized=True, static_input_scale=static,
                           tensor_scales=weights.get("strategy") == "tensor")


def ignored(pattern: str, module: str) -> bool:
    """Whether an `ignore` entry names this checkpoint module ("re:<regex>" or a name, matched whole or as
    the module's last part, e.g. "lm_head")."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


class CompressedTensorsQuantizer(Quantizer):
    """Loads compressed-tensors int8, int4 and fp8 checkpoints. Options: `kernel`, `dense_threshold` (as for int8
    or fp8), `activations` (fp8: "none" or "fp8", as for the fp8 quantizer; default: what the checkpoint says)."""

    checkpoint_format = "compressed-tensors"

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        threshold = self.options.get("dense_threshold")
        self.kernel = str(self.options.get("kernel", "auto"))
        self.threshold = None if threshold is None else int(threshold)
        self.ignore: tuple[str, ...] = ()
        self.method: LinearMethod | None = None  # chosen by `prepare`, from the checkpoint's scheme

    def prepare(self, context: QuantizationContext) -> None:
        config = context.checkpoint_quantization
        if config is None or config.get("quant_method") != self.checkpoint_format:
            found = "none" if config is None else repr(config.get("quant_method"))
            raise QuantizationError(f"quantization 'compressed-tensors' loads checkpoints quantized in that format "
                                    f"(config.json quantization_config.quant_method = \"compressed-tensors\"); "
                                    f"this one's is {found}")
        if context.position != len(context.chain) - 1:
            raise QuantizationError("quantization 'compressed-tensors' loads stored int8 weights, so it must come "
                                    f"last (methods: {', '.join(context.chain)}); a transform before it would need "
                                    "full-precision weights, which this checkpoint does not have")
        fmt = config.get("format")
        if fmt not in FORMATS:
            raise QuantizationError(f"not supported yet: compressed-tensors format {fmt!r} (supported: "
                                    f"{', '.join(FORMATS)})")
        for key in ("kv_cache_scheme", "sparsity_config"):
            if config.get(key):
                raise QuantizationError(f"not supported yet: compressed-tensors {key}")
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise QuantizationError(f"not supported yet: compressed-tensors with {len(groups)} config_groups "
                                    "(one group, targets [\"Linear\"], is)")
        (name, group), = groups.items()
        where = f"quantization_config.config_groups.{name}"
        if list(group.get("targets") or []) != ["Linear"]:
            raise QuantizationError(f"not supported yet: {where}.targets {group.get('targets')!r} (only [\"Linear\"])")
        if (group.get("weights") or {}).get("type") == "float":
            self.ignore = tuple(config.get("ignore") or ())
            self.method = fp8_method(group, where, fmt, self.options)
            return
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise QuantizationError(f"not supported yet: {where}.{key} (activation quantization); "
                                        "weight-only int8 is")
        weights = group.get("weights") or {}
        if weights.get("num_bits") == 4:
            self.ignore = tuple(config.get("ignore") or ())
            self.method = int4_method(weights, where, fmt, self.options)
            return
        if fmt == "float-quantized":
            raise QuantizationError(f"not supported yet: compressed-tensors int weights in format {fmt!r} "
                                    "(float-quantized holds fp8: weights.type \"float\")")
        wanted = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        for key, value in wanted.items():
            if weights.get(key) != value:
                raise QuantizationError(f"not supported yet: {where}.weights.{key} = {weights.get(key)!r} "
                                        f"(supported: {value!r})")
        if weights.get("dynamic") or weights.get("group_size") is not None:
            raise QuantizationError(f"not supported yet: {where}.weights with dynamic or group_size")
        self.ignore = tuple(config.get("ignore") or ())
        packed = fmt == "pack-quantized"
        self.method = (PackedInt8LinearMethod if packed else Int8LinearMethod)(self.kernel, self.threshold,
                                                                               prequantized=True)

    def linear_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        assert self.method is not None, "prepare() first"
        if inner is not UNQUANTIZED:
            raise QuantizationError("quantization 'compressed-tensors' must be the last method")
        skipped = [any(ignored(p, m) for p in self.ignore) for m in spec.checkpoint_prefixes]
        if all(skipped):
            return inner  # stored in full precision
        if any(skipped):
            raise QuantizationError(f"{spec.prefix}: the checkpoint quantizes some of "
                                    f"{', '.join(spec.checkpoint_prefixes)} and ignores others; this engine fuses "
                                    "them into one layer, which must be stored one way")
        return self.method
