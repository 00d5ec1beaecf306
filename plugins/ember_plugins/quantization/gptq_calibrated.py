"""`gptq` on a full-precision checkpoint: calibrate on text, quantize each linear with GPTQ, store the result in
int8 or int4 layers.

    [quantization]
    method = "gptq"
    options = { bits = 4, group_size = 128, sym = true, act_order = true, damp = 0.01 }

Options (each checked; anything else is refused): `bits` 4 or 8; `group_size` columns per scale (-1: one scale
per output channel; 8-bit weights go into the int8 layers, which hold one scale per channel, so 8 bits needs -1);
`sym` (symmetric grid; 8 bits must be); `act_order` (columns by decreasing Hessian diagonal, g_idx stored);
`damp` (fraction of the mean Hessian diagonal added to it, 0 < damp <= 1); `num_samples` and `seq_len` (how
much calibration text is used: at most num_samples sequences of seq_len tokens); `skip` (layers kept in full
precision, default ["lm_head")).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
    linear_modules,
    skipped,
)
from ember_plugins.quantization.gptq_int4 import gptq_tensors
from ember_plugins.quantization.gptq_quantize import QuantizedWeight, gptq_quantize
from ember_plugins.quantization.gptq_sequential import calibrate_sequentially
from ember_plugins.quantization.int4 import in_input_order
from ember_plugins.quantization.int8 import Int8LinearMethod
from ember_plugins.quantization.options import GPTQSettings

log = logging.getLogger("ember.gptq")

def _where(key: str) -> str:
    return f"quantization.options.{key}"


class GPTQStoredMethod(LinearMethod):
    """What a gptq layer holds once quantized (int8 or int4 tensors, through `storage`): the method that loads it
    back from the engine's cache or a package's quantized weights, named as gptq's."""

    full_precision_until_loaded = False

    def __init__(self, settings: GPTQSettings, storage: LinearMethod) -> None:
        self.settings, self.storage = settings, storage

    def create_weights(self, layer: Linear) -> None:
        self.storage.create_weights(layer)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        self.storage.load_weight(layer, name, param, loaded, shard_id)

    def after_loading(self, layer: Linear) -> None:
        self.storage.after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.storage.apply(layer, x, bias)

    def describe(self, layer: Linear) -> str:
        return f"{self.settings.describe()}: {self.storage.describe(layer).removeprefix('gptq checkpoint, ')}"


class GPTQCalibratedMethod(GPTQStoredMethod):
    """Loads the full-precision weight; `GPTQ.calibrate` replaces it with its quantized values (the dequantized
    weight, and the levels as `_gptq_result`), and finalizing turns them into the storage method's tensors."""

    full_precision_until_loaded = True

    def __init__(self, settings: GPTQSettings, storage: LinearMethod,
                 tensors: Callable[[QuantizedWeight, torch.dtype], dict[str, torch.Tensor]]) -> None:
        super().__init__(settings, storage)
        self.tensors = tensors

    def create_weights(self, layer: Linear) -> None:
        layer.add_weight("weight", (layer.out_features, layer.in_features), None)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        LinearMethod.load_weight(self, layer, name, param, loaded, shard_id)

    def after_loading(self, layer: Linear) -> None:
        result = layer.__dict__.pop("_gptq_result", None)
        if result is None:
            raise QuantizationError(f"gptq: a layer of {layer.in_features} inputs was finalized without being "
                                    "calibrated (its calibration never ran)")
        dtype, device = layer.weight.dtype, layer.weight.device
        del layer.weight  # the full-precision copy goes now
        saved = {name: t.to(device) for name, t in self.tensors(result, dtype).items()}
        for name, tensor in saved.items():  # loaded as a checkpoint's tensors are, then into the kernel's layout
            param = nn.Parameter(tensor, requires_grad=False)
            layer.register_parameter(name, param)
            self.storage.load_weight(layer, name, param, tensor, None)
        self.storage.after_loading(layer)
        held = {name: p for name, p in layer._parameters.items() if p is not None and p is not layer.bias}
        if set(held) != set(saved):
            # A kernel layout of its own (int4's, chosen per machine): the layer computes with it, kept as plain
            # attributes, and keeps the portable tensors as its parameters, what the cache and packages save.
            for name, param in held.items():
                del layer._parameters[name]
                setattr(layer, name, param.data)
            for name, tensor in saved.items():
                layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        order = layer.__dict__.get("int4_input_order")  # act-order int4, moved out of the parameters above
        if order is not None:
            x = in_input_order(x.reshape(-1, layer.in_features), order).view(*x.shape)
        return self.storage.apply(layer, x, bias)


def int8_tensors(result: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Symmetric 8-bit levels (zero 128, 1..255) as the int8 layers store them: weight int8, weight_scale [out]."""
    return {"weight": (result.q - result.zeros).to(torch.int8), "weight_scale": result.scales[:, 0].float()}


class GPTQ:
    """The calibrating side of quantization 'gptq' (GPTQQuantizer delegates to it for a full-precision checkpoint)."""

    def __init__(self, settings: GPTQSettings, context: QuantizationContext) -> None:
        self.settings = settings
        if context.position != len(context.chain) - 1:
            raise QuantizationError(f"quantization 'gptq' stores int{settings.bits} weights, so it must be the last "
                                    f"method (methods: {', '.join(context.chain)})")
        max_len = context.hf_config.get("max_position_embeddings")
        if isinstance(max_len, int) and settings.seq_len > max_len:
            raise QuantizationError(f"{_where('seq_len')} = {settings.seq_len}: longer than the model's "
                                    f"max_position_embeddings ({max_len})")
        if settings.bits == 8:
            storage: LinearMethod = Int8LinearMethod(settings.kernel, prequantized=True)
            self.method = GPTQCalibratedMethod(settings, storage, int8_tensors)
        else:
            from ember_plugins.quantization.int4_checkpoints import GPTQInt4Method

            storage = GPTQInt4Method(settings.group_size, settings.kernel)
            self.method = GPTQCalibratedMethod(settings, storage, gptq_tensors)
        self.restored = GPTQStoredMethod(settings, storage)

    def linear_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        if inner is not UNQUANTIZED:
            raise QuantizationError("quantization 'gptq' must be the last method")
        return inner if skipped(spec, self.settings.skip) else self.method

    def restored_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        return inner if skipped(spec, self.settings.skip) else self.restored

    def calibrate(self, calibration: CalibrationContext) -> None:
        s = self.settings
        # A technique before gptq may wrap its method (an online rotation: `inner` is the method it wraps); the
        # Hessian is then of what the wrapped method multiplies, which the wrapper says (`calibration_input`).
        wrappers: dict[int, list[LinearMethod]] = {}
        targets = {}
        for name, layer in linear_modules(calibration.model):
            chain, method = [], layer.method
            while method is not self.method and method is not None:
                chain.append(method)
                method = getattr(method, "inner", None)
            if method is None or layer.finalized:
                continue
            for wrapper in chain:
                if not callable(getattr(wrapper, "calibration_input", None)):
                    raise QuantizationError(f"gptq: {name}: {type(wrapper).__name__} wraps gptq's layers without "
                                            "saying what input their weights see (calibration_input(layer, x)), "
                                            "which GPTQ's Hessian needs")
            targets[name], wrappers[id(layer)] = layer, chain

        def layer_input(layer: Linear, x: torch.Tensor) -> torch.Tensor:
            for wrapper in wrappers[id(layer)]:
                x = wrapper.calibration_input(layer, x)  # type: ignore[attr-defined]
            return x

        ids = calibration.tokenizer.encode(calibration.text, add_special_tokens=False)[: s.num_samples * s.seq_len]
        sequences = [ids[i:i + s.seq_len] for i in range(0, len(ids), s.seq_len)]
        sequences = [seq for seq in sequences if len(seq) > 1]
        if not sequences:
            raise QuantizationError(f"gptq: the calibration text ({calibration.source}) has no tokens to calibrate on")
        log.info("gptq: calibrating %d layers on %d tokens of %s (%s)", len(targets), sum(map(len, sequences)),
                 calibration.source, s.describe())

        def quantize(name: str, layer: Linear, hessian: torch.Tensor) -> None:
            try:
                result = gptq_quantize(layer.weight.data, hessian, bits=s.bits, group_size=s.group_size,
                                       symmetric=s.sym, act_order=s.act_order, damp=s.damp)
            except ValueError as e:
                raise QuantizationError(f"gptq: {name}: {e} ({_where('damp')})") from None
            # Until the engine finalizes every layer, this one computes with its dequantized weight: the function
            # its stored form computes, without unpacking it at every calibration pass.
            layer.weight.data = result.dequantize(layer.weight.dtype).to(layer.weight.device)
            layer._gptq_result = result

        with torch.no_grad():
            calibrate_sequentially(calibration, targets, sequences, quantize, layer_input)
