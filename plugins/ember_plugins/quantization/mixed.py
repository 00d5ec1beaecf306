"""`mixed`: outlier-aware mixed precision. Each linear gets int4, int8 or stays dense, chosen on calibration data
under a size budget (`average_bits` over the layers it covers), so that the layers whose quantization costs the
most loss keep more bits.

The plan, made in `calibrate` before any layer is finalized:

1. Measure each covered layer on the calibration text: its input's outlier statistics (max over input channels of
   max |x|, divided by their mean; kurtosis of the inputs), and its sensitivity: the increase of the model's
   calibration loss when that layer alone is rounded to int4 (round to nearest, as `int4` stores it), and to int8.
2. Start with every layer at int4 (the smallest), then repeatedly make the upgrade (int4 -> int8, -> dense) with
   the largest loss saved per extra bit that still fits the budget, until none does. Ties go by layer name, so
   the plan is the same on every run of the same weights and text.

Bits per weight count what the layers store: int4 4 + 40 / group (a float32 scale and a uint8 zero point per
group, `Int4Weights`), int8 8 + 32 / inputs (a float32 scale per output), dense the model dtype's bits. Layers in
`skip` (default the LM head) stay dense and are outside the budget. The plan is `state()`: saved as
`quantization.json` beside the engine's quantized-weight cache and printed by `ember explain`.

Sensitivities are measured one layer at a time (interactions ignored, as HAWQ / Baseten-style layer selection
does): 2 passes of the calibration text per covered layer.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
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
    skipped,
)
from ember_plugins.quantization.int4 import DEFAULT_GROUP, GROUP_SIZES, Int4LinearMethod, quantize_rtn
from ember_plugins.quantization.int8 import Int8LinearMethod, quantize_per_channel
from ember_plugins.quantization.options import check_mixed, checked

RULE = ("every covered layer int4 in the largest groups, then the upgrade (smaller int4 groups, int8, dense) "
        "saving the most sensitivity per extra bit, while the average bits per weight stay within average_bits; "
        "sensitivity = KL divergence of the calibration logits from full precision with that layer alone quantized")


def precisions(group_size: int) -> tuple[str, ...]:
    """The ladder a layer climbs, cheapest first: int4 in groups of `group_size` and every smaller group, int8,
    dense (e.g. int4-g128, int4-g64, int4-g32, int8, dense)."""
    groups = sorted((g for g in GROUP_SIZES if g <= group_size), reverse=True)
    return (*(f"int4-g{g}" for g in groups), "int8", "dense")


def int4_group(precision: str) -> int | None:
    return int(precision.removeprefix("int4-g")) if precision.startswith("int4-g") else None


def bits_per_weight(precision: str, in_features: int, dtype: torch.dtype) -> float:
    """What a layer stores per weight at `precision` (see the module docs)."""
    group = int4_group(precision)
    if group is not None:
        return 4 + 40 / group
    if precision == "int8":
        return 8 + 32 / in_features
    return float(torch.finfo(dtype).bits)


def outlier_stats(x: torch.Tensor) -> tuple[float, float]:
    """(max / mean over input channels of max |x|, kurtosis of x's values) for inputs [tokens, in]."""
    x = x.float()
    channel_max = x.abs().amax(dim=0)
    ratio = float(channel_max.max() / channel_max.mean().clamp(min=1e-12))
    centered = x - x.mean()
    kurtosis = float(centered.pow(4).mean() / centered.pow(2).mean().clamp(min=1e-24).pow(2))
    return ratio, kurtosis


def plan_layers(layers: Mapping[str, Mapping[str, Any]], budget_bits: float, ladder: tuple[str, ...]) -> dict[str, str]:
    """The greedy plan (module docs) over `layers`: name -> {"params", "bits": {precision: bits per weight},
    "loss": {precision: loss increase}}, each climbing `ladder` (cheapest first); returns name -> precision."""
    choice = {name: ladder[0] for name in layers}
    total = sum(layer["params"] for layer in layers.values())
    spent = sum(layer["params"] * layer["bits"][ladder[0]] for layer in layers.values())
    budget = budget_bits * total
    while True:
        best: tuple[float, str, str, float] | None = None  # (-gain per bit, name, precision, extra bits)
        for name in sorted(layers):
            layer, current = layers[name], choice[name]
            for precision in ladder[ladder.index(current) + 1:]:
                extra = layer["params"] * (layer["bits"][precision] - layer["bits"][current])
                gain = layer["loss"][current] - layer["loss"][precision]
                if gain <= 0 or spent + extra > budget + 1e-9 * total:
                    continue
                candidate = (-gain / extra, name, precision, extra)
                if best is None or candidate[:3] < best[:3]:
                    best = candidate
        if best is None:
            return choice
        _, name, precision, extra = best
        choice[name] = precision
        spent += extra


class MixedLinearMethod(LinearMethod):
    """Loads a full-precision weight; once the plan is made, stores it as its precision says (int4's or int8's
    method, or kept dense) and computes through that."""

    def __init__(self, technique: MixedQuantizer, prefix: str) -> None:
        self.technique, self.prefix = technique, prefix

    def create_weights(self, layer: Linear) -> None:
        layer.add_weight("weight", (layer.out_features, layer.in_features), None)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Hashable | None) -> None:
        UNQUANTIZED.load_weight(layer, name, param, loaded, shard_id)

    def after_loading(self, layer: Linear) -> None:
        method = self.technique.method_of(self.prefix)
        method.after_loading(layer)
        layer.mixed_method = method  # per layer: one MixedLinearMethod per layer, but state stays on the layer

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.mixed_method.apply(layer, x, bias)

    def describe(self, layer: Linear) -> str:
        method = getattr(layer, "mixed_method", None)
        return f"mixed: {method.describe(layer) if method is not None else 'planned at calibration'}"


def _option_name(context: QuantizationContext | None, key: str) -> str:
    if context is not None and len(context.chain) > 1:
        return f"quantization.options.{context.chain[context.position]}.{key}"
    return f"quantization.options.{key}"


class MixedQuantizer(Quantizer):
    """Options: `average_bits` (the budget, bits per weight over the covered layers; default 5.0; at least int4's
    4 + 40 / group_size); `group_size` (int4's groups: 32, 64 or 128; default 128); `symmetric` (int4's rounding,
    default true); `skip` (layers kept dense, outside the budget; default ["lm_head"]). It stores weights, so it
    comes last (after `rotation`, say)."""

    needs_calibration = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.average_bits = self.options.get("average_bits", 5.0)
        self.group_size = self.options.get("group_size", DEFAULT_GROUP)
        self.symmetric = self.options.get("symmetric", True)
        self.skip = self.options.get("skip", ["lm_head"])
        self._check(None)
        self.layers: dict[str, dict[str, Any]] = {}  # covered layer -> its size, bits per precision
        self.plan: dict[str, Any] | None = None
        self.ladder = precisions(self.group_size)
        self._methods: dict[str, LinearMethod] = {"int8": Int8LinearMethod(), "dense": UNQUANTIZED}
        for precision in self.ladder:
            group = int4_group(precision)
            if group is not None:
                self._methods[precision] = Int4LinearMethod(group, self.symmetric)

    def _check(self, context: QuantizationContext | None) -> None:
        # What ember checks a manifest with too (options.py), under the key this table has in the composition.
        prefix = _option_name(context, "").removesuffix(".")
        checked(check_mixed, self.options, prefix)

    def prepare(self, context: QuantizationContext) -> None:
        super().prepare(context)
        self._check(context)
        if context.position != len(context.chain) - 1:
            raise QuantizationError(f"quantization 'mixed' stores the weights, so it must be the last method "
                                    f"(after it comes '{context.chain[context.position + 1]}')")

    def linear_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        if inner is not UNQUANTIZED:
            raise QuantizationError(f"quantization 'mixed' stores the weights of {spec.prefix}, so it must be the "
                                    f"last method (after it comes {type(inner).__name__})")
        if skipped(spec, tuple(self.skip)):
            return inner
        self.layers[spec.prefix] = {
            "params": spec.in_features * spec.out_features,
            "bits": {p: bits_per_weight(p, spec.in_features, spec.dtype) for p in self.ladder},
        }
        return MixedLinearMethod(self, spec.prefix)

    def method_of(self, prefix: str) -> LinearMethod:
        if self.plan is None:
            raise QuantizationError("quantization 'mixed': a layer finished loading before the plan was made "
                                    "(calibration did not run)")
        return self._methods[self.plan["layers"][prefix]["precision"]]

    def _fake_quantized(self, precision: str, weight: torch.Tensor) -> torch.Tensor:
        """The weight the layer would compute with at `precision` (what int4's / int8's methods store)."""
        group = int4_group(precision)
        if group is not None:
            return quantize_rtn(weight, group, self.symmetric).dequantize(weight.dtype)
        q, scale = quantize_per_channel(weight)
        return (q.float() * scale[:, None]).to(weight.dtype)

    def calibrate(self, calibration: CalibrationContext) -> None:
        model = calibration.model
        inputs = calibration.capture(self.layers)
        reference = [torch.log_softmax(lg, dim=-1) for lg in calibration.logits()]
        tokens = sum(len(lp) for lp in reference)

        def divergence() -> float:
            """Mean KL(full precision || now) per calibration token: always >= 0 and far less noisy than the
            loss difference it bounds (a layer's rounding moves the loss by ~1e-4 nats either way)."""
            total = 0.0
            for ref, logits in zip(reference, calibration.logits(), strict=True):
                total += float(torch.nn.functional.kl_div(torch.log_softmax(logits, dim=-1), ref, log_target=True,
                                                          reduction="sum"))
            return total / tokens

        base = calibration.loss()
        measured: dict[str, dict[str, Any]] = {}
        for name in sorted(self.layers):
            layer = model.get_submodule(name)
            weight = layer.weight.data
            original = weight.clone()
            loss = {"dense": 0.0}
            for precision in self.ladder[:-1]:
                weight.copy_(self._fake_quantized(precision, original))
                loss[precision] = divergence()
            weight.copy_(original)
            ratio, kurtosis = outlier_stats(inputs[name])
            measured[name] = {**self.layers[name], "loss": loss, "outlier_ratio": ratio, "kurtosis": kurtosis}
        choice = plan_layers(measured, float(self.average_bits), self.ladder)
        total = sum(m["params"] for m in measured.values())
        achieved = sum(m["params"] * m["bits"][choice[n]] for n, m in measured.items()) / total
        self.plan = {
            "rule": RULE,
            "average_bits": float(self.average_bits),
            "achieved_bits": round(achieved, 4),
            "ladder": list(self.ladder),
            "symmetric": self.symmetric,
            "skip": list(self.skip),
            "calibration_tokens": sum(len(s) for s in calibration.token_sequences()),
            "calibration_source": str(calibration.source),
            "calibration_loss": round(base, 6),
            "layers": {name: {"precision": choice[name], "bits": round(m["bits"][choice[name]], 4),
                              "params": m["params"],
                              "sensitivity": {p: round(v, 8) for p, v in m["loss"].items()},
                              "input_outlier_ratio": round(m["outlier_ratio"], 3),
                              "input_kurtosis": round(m["kurtosis"], 3)}
                       for name, m in measured.items()},
        }

    def state(self) -> Mapping[str, Any] | None:
        return self.plan
