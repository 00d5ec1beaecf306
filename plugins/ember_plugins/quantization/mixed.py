"""`mixed`: outlier-aware mixed precision. Each linear gets int4, int8 or stays dense, chosen on calibration data
under a size budget (`average_bits` over the layers it covers), so that the layers whose quantization costs the
most loss keep more bits.

The plan, made in `calibrate` before any layer is finalized, on calibration text only:

1. Measure each covered layer on the calibration text: its input's outlier statistics (max over input channels of
   max |x|, divided by their mean; kurtosis of the inputs), and its sensitivity to each rung of the ladder (int4
   in every group size up to `group_size`, round to nearest as `int4` stores it; int8), with that layer alone
   rounded: the KL divergence of the calibration logits from full precision (second order, steady) and the
   increase of the calibration cross-entropy (what perplexity measures: its first-order part is the direction
   of the rounding against the loss's gradient, which KL cannot see).
2. Candidate plans within the budget, for each of the two sensitivities: the greedy one (every layer at int4 in
   the largest groups, then repeatedly the upgrade with the largest sensitivity saved per extra bit that still
   fits, ties by layer name) and the one of least total sensitivity (`knapsack_plan`, exact: it may also give a
   layer fewer bits so another gets more); and every uniform int4 that fits.
3. Each candidate is measured whole (every covered layer rounded as planned at once, so interactions count): the
   one with the lowest calibration cross-entropy is the plan (ties: the order above), so the plan is never
   measurably worse on calibration text, in the perplexity's own measure, than the uniform int4 of the same bits.
   Choosing by KL instead (what this did before, on 2048 tokens) kept plans whose KL was lower but whose
   perplexity was not. Example model, held-out perplexity (bench/eval_quantization.py, all 172 windows): at int4
   g64's bits 52.2672 (by KL: 52.3107; int4 g64 52.3057); at int4 g32's 52.2487 (by KL: 52.2667; int4 g32 52.2346,
   still below: its rounding happens to lower the held-out loss by ~0.0016 nats more than its KL, which the
   calibration text does not show).

What is measured is what will serve: where int4 layers run the native CPU kernel, which rounds each row's
activations to int8 per weight group (W4A8), every measurement above rounds the int4 layers' inputs the same way
(`round_activations_per_group`; the plan's `int4_activations` says which); before, the plan was chosen with
weight-only rounding for a model that computes W4A8.

Bits per weight count what the layers store: int4 4 + 40 / group (a float32 scale and a uint8 zero point per
group, `Int4Weights`), int8 8 + 32 / inputs (a float32 scale per output), dense the model dtype's bits. Layers in
`skip` (default the LM head) stay dense and are outside the budget. The plan is `state()`: saved as
`quantization.json` beside the engine's quantized-weight cache (and in a package's `ember quantize` entry) and
printed by `ember explain`; a later start restores it (`restore_state`) and loads each layer's saved int4 / int8
tensors through its precision's method (`restored_method`), without calibrating or quantizing.

Sensitivities are measured one layer at a time (interactions ignored there, as HAWQ / Baseten-style layer
selection does; step 3 measures them): a pass of the first `calibration_tokens` (option, default 16384) of the
calibration text per covered layer and rung, and one per candidate plan. That many because the first-order part is
a mean over tokens whose per-token spread is far larger than the 1e-4 nats plans differ by: on 2048 tokens the
estimate chose worse plans. It costs about 70 passes of 16384 tokens: on the example model about 5 minutes on one
CPU thread of a loaded machine (17 s with 2048 tokens), once per model, the plan then restored from the
quantized-weight cache.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember_kernels.cpu.int4_linear import quantize_activations
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
from ember_plugins.quantization.int4 import (
    DEFAULT_GROUP,
    GROUP_SIZES,
    Int4LinearMethod,
    Int4StoredMethod,
    prefill_rounds_activations,
    quantize_rtn,
)
from ember_plugins.quantization.int8 import Int8LinearMethod, quantize_per_channel
from ember_plugins.quantization.options import MIXED_CALIBRATION_TOKENS, check_mixed, checked

SEQUENCE = 256
SENSITIVITIES = {"kl": "KL", "loss": "loss increase"}  # measured key -> the name candidates built on it carry
RULE = ("within average_bits per weight: of the greedy plan (every covered layer int4 in the largest groups, then "
        "the upgrade saving the most sensitivity per extra bit) and the plan of least total sensitivity (exact "
        "knapsack), each by KL and by loss increase, and each uniform int4 that fits, the one whose whole quantized "
        "model has the lowest calibration cross-entropy; sensitivities of a layer alone quantized: KL divergence "
        "of the calibration logits from full precision, and the calibration cross-entropy's increase")


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


def knapsack_plan(layers: Mapping[str, Mapping[str, Any]], budget_bits: float, ladder: tuple[str, ...],
                  resolution: int = 1 << 16) -> dict[str, str]:
    """The plan of least total sensitivity (the sum of the layers' losses) within the budget: the exact optimum of
    that multiple-choice knapsack, by dynamic programming over bits spent, counted in `resolution` steps of the
    budget (each layer's cost rounded up, so the plan never exceeds the budget). Where `plan_layers`' greedy
    climbs one upgrade at a time, this may also give a layer fewer bits to give another more."""
    names = sorted(layers)
    total = sum(layers[n]["params"] for n in names)
    budget = budget_bits * total
    unit = budget / resolution
    inf = float("inf")
    best = torch.full((resolution + 1,), inf, dtype=torch.float64)  # least loss at exactly this many units spent
    best[0] = 0.0
    choices = []
    for name in names:
        layer = layers[name]
        new = torch.full_like(best, inf)
        pick = torch.full((resolution + 1,), -1, dtype=torch.long)
        for i, precision in enumerate(ladder):
            cost = math.ceil(layer["params"] * layer["bits"][precision] / unit - 1e-9)
            if cost > resolution:
                continue
            shifted = torch.full_like(best, inf)
            shifted[cost:] = best[:resolution + 1 - cost] + layer["loss"][precision]
            better = shifted < new
            new = torch.where(better, shifted, new)
            pick = torch.where(better, torch.tensor(i), pick)
        best = new
        choices.append(pick)
    if not math.isfinite(float(best.min())):
        return {name: ladder[0] for name in names}  # nothing fits (a budget below int4): the cheapest everywhere
    spent = int(torch.argmin(best))
    plan: dict[str, str] = {}
    for name, pick in zip(reversed(names), reversed(choices), strict=True):
        precision = ladder[int(pick[spent])]
        plan[name] = precision
        spent -= math.ceil(layers[name]["params"] * layers[name]["bits"][precision] / unit - 1e-9)
    return plan


def round_activations_per_group(group_size: int) -> Any:
    """A forward pre-hook giving a linear its input as the native int4 kernel computes with it: each row rounded
    to int8 per group of `group_size` inputs (symmetric, max |x| / 127; `quantize_activations`), dequantized."""

    def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_activations(rows, group_size)
        rounded = (xq * xs[..., None]).reshape(rows.shape[0], -1)[:, :x.shape[-1]]
        return (rounded.to(x.dtype).reshape(x.shape), *args[1:])

    return hook


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

    def portable_tensors(self, layer: Linear) -> Mapping[str, torch.Tensor] | None:
        return layer.mixed_method.portable_tensors(layer)

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
        self.calibration_tokens = int(self.options.get("calibration_tokens", MIXED_CALIBRATION_TOKENS))
        self.layers: dict[str, dict[str, Any]] = {}  # covered layer -> its size, bits per precision
        self.plan: dict[str, Any] | None = None
        self.ladder = precisions(self.group_size)
        self._methods: dict[str, LinearMethod] = {"int8": Int8LinearMethod(), "dense": UNQUANTIZED}
        # What each precision's layers saved, loaded back (the quantized-weight cache, `ember quantize`).
        self._restored: dict[str, LinearMethod] = {"int8": Int8LinearMethod(prequantized=True), "dense": UNQUANTIZED}
        for precision in self.ladder:
            group = int4_group(precision)
            if group is not None:
                self._methods[precision] = Int4LinearMethod(group, self.symmetric)
                self._restored[precision] = Int4StoredMethod(group)

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

    def restored_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        """The layer as its saved plan (`restore_state`) stored it: int4 in its groups, int8, or dense."""
        if skipped(spec, tuple(self.skip)):
            return inner
        if self.plan is None:
            raise QuantizationError("quantization 'mixed': these quantized weights were saved without their plan")
        layer = self.plan["layers"].get(spec.prefix)
        if layer is None:
            raise QuantizationError(f"quantization 'mixed': the saved plan has no precision for {spec.prefix}")
        return self._restored[layer["precision"]]

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """The plan saved with the weights: each layer's precision, one of this configuration's ladder."""
        layers = state.get("layers")
        if not isinstance(layers, Mapping):
            raise QuantizationError("quantization 'mixed': the saved plan has no 'layers' table")
        for name, layer in layers.items():
            precision = layer.get("precision") if isinstance(layer, Mapping) else None
            if precision not in self._restored:
                raise QuantizationError(f"quantization 'mixed': the saved plan gives {name} precision {precision!r}, "
                                        f"not one of {', '.join(self.ladder)}")
        self.plan = dict(state)

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
        # Sensitivities on more text than the shared capture's (512 tokens): see the module docs.
        ids = calibration.tokenizer.encode(calibration.text, add_special_tokens=False)[:self.calibration_tokens]
        sequences = [s for s in (ids[i:i + SEQUENCE] for i in range(0, len(ids), SEQUENCE)) if len(s) > 1]
        if not sequences:
            raise QuantizationError(f"quantization 'mixed': the calibration text ({calibration.source}) has no tokens")
        targets = [torch.tensor(s[1:]) for s in sequences]

        def log_probs() -> list[torch.Tensor]:
            with torch.inference_mode():
                return [torch.log_softmax(model.compute_logits(calibration.run(s)).float(), dim=-1) for s in sequences]

        def cross_entropy(got: list[torch.Tensor]) -> float:
            """Mean next-token cross-entropy (nats) over the calibration sequences: the perplexity's measure."""
            total = sum(float(F.nll_loss(lp[:-1], t.to(lp.device), reduction="sum")) for lp, t in zip(got, targets,
                                                                                                     strict=True))
            return total / sum(len(t) for t in targets)

        reference = log_probs()
        tokens = sum(len(lp) for lp in reference)
        base = cross_entropy(reference)

        def measure() -> dict[str, float]:
            """The model as it computes now: mean KL(full precision || now) per calibration token (>= 0, steady)
            and the increase of the calibration cross-entropy (what perplexity sees, noisier), from one pass."""
            got = log_probs()
            kl = sum(float(F.kl_div(g, r, log_target=True, reduction="sum")) for g, r in zip(got, reference,
                                                                                            strict=True))
            return {"kl": kl / tokens, "loss": cross_entropy(got) - base}

        # What serves: where int4 layers will run the native CPU kernel, their activations are rounded to int8 per
        # group too (W4A8), so every measurement below rounds them as well, or the plan would be chosen for a model
        # that never runs.
        w4a8 = prefill_rounds_activations("auto", model.device, model.dtype)

        def measure_as(plan: Mapping[str, str]) -> dict[str, float]:
            """`measure` with the int4 layers of `plan` (name -> precision, weights already rounded) computing on
            rounded activations where the served kernel rounds them."""
            handles = [model.get_submodule(name).register_forward_pre_hook(round_activations_per_group(group))
                       for name, precision in plan.items()
                       if w4a8 and (group := int4_group(precision)) is not None]
            try:
                return measure()
            finally:
                for handle in handles:
                    handle.remove()

        measured: dict[str, dict[str, Any]] = {}
        for name in sorted(self.layers):
            layer = model.get_submodule(name)
            weight = layer.weight.data
            original = weight.clone()
            kl, loss = {"dense": 0.0}, {"dense": 0.0}
            for precision in self.ladder[:-1]:
                weight.copy_(self._fake_quantized(precision, original))
                m = measure_as({name: precision})
                kl[precision], loss[precision] = m["kl"], m["loss"]
            weight.copy_(original)
            ratio, kurtosis = outlier_stats(inputs[name])
            measured[name] = {**self.layers[name], "kl": kl, "loss": loss, "outlier_ratio": ratio,
                              "kurtosis": kurtosis}
        # Candidate plans within the budget (module docs, step 2), each measured whole (step 3).
        budget = float(self.average_bits)
        total = sum(m["params"] for m in measured.values())
        candidates: dict[str, dict[str, str]] = {}
        for key, label in SENSITIVITIES.items():
            by = {name: {**m, "loss": m[key]} for name, m in measured.items()}  # what the planners minimize
            suffix = "" if key == "kl" else f" by {label}"  # "greedy" and "knapsack": by KL, as plans saved before
            candidates[f"greedy{suffix}"] = plan_layers(by, budget, self.ladder)
            candidates[f"knapsack{suffix}"] = knapsack_plan(by, budget, self.ladder)
        for precision in self.ladder:
            if int4_group(precision) is not None and \
                    sum(m["params"] * m["bits"][precision] for m in measured.values()) <= budget * total + 1e-9:
                candidates[f"uniform {precision}"] = {name: precision for name in measured}
        originals = {name: model.get_submodule(name).weight.data.clone() for name in measured}
        scores: dict[str, dict[str, float]] = {}
        for label, plan in candidates.items():
            same = next((other for other in scores if candidates[other] == plan), None)
            if same is not None:
                scores[label] = scores[same]
                continue
            for name, precision in plan.items():
                if precision != "dense":
                    model.get_submodule(name).weight.data.copy_(self._fake_quantized(precision, originals[name]))
            scores[label] = measure_as(plan)
            for name in plan:
                model.get_submodule(name).weight.data.copy_(originals[name])
        del originals
        # The perplexity's own measure decides; ties: the first listed.
        chosen = min(candidates, key=lambda label: scores[label]["loss"])
        choice = candidates[chosen]
        achieved = sum(m["params"] * m["bits"][choice[n]] for n, m in measured.items()) / total
        self.plan = {
            "rule": RULE,
            "average_bits": float(self.average_bits),
            "achieved_bits": round(achieved, 4),
            "ladder": list(self.ladder),
            "symmetric": self.symmetric,
            "int4_activations": "int8 per group (the native CPU kernel's W4A8)" if w4a8 else "unrounded",
            "skip": list(self.skip),
            "calibration_tokens": tokens,
            "calibration_source": str(calibration.source),
            "calibration_loss": round(base, 6),
            "plan": chosen,
            "plan_loss_increase": {label: round(score["loss"], 8) for label, score in scores.items()},
            "plan_kl": {label: round(score["kl"], 8) for label, score in scores.items()},
            "layers": {name: {"precision": choice[name], "bits": round(m["bits"][choice[name]], 4),
                              "params": m["params"],
                              "sensitivity": {p: round(v, 8) for p, v in m["kl"].items()},
                              "loss_increase": {p: round(v, 8) for p, v in m["loss"].items()},
                              "input_outlier_ratio": round(m["outlier_ratio"], 3),
                              "input_kurtosis": round(m["kurtosis"], 3)}
                       for name, m in measured.items()},
        }

    def state(self) -> Mapping[str, Any] | None:
        return self.plan
