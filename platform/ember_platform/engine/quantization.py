"""The quantizer contract (documented engine API for quantization plugins): a technique picks each linear
layer's `LinearMethod` before the weights load.

    [quantization]
    method = "int8"                    # one technique
    method = ["smooth", "int8"]        # several, composed in this order: smooth's transform, then int8's storage

Composition: the engine asks the techniques for each layer's method from the last to the first, each given the
method of the techniques after it (`inner`; the unquantized method at the end). A technique that stores weights
(int8) returns its own method and may only come last; one that transforms full-precision weights before they are
stored (a rotation, smoothing) wraps `inner` and must refuse an inner method that does not hold full-precision
weights. A checkpoint that is already quantized (`config.json`'s `quantization_config`) loads through the
technique registered under its `quant_method` ("compressed-tensors", "gptq").

A transform that rewrites more than one linear at a time (a rotation folds norms into the linears after them and
rotates the embeddings) sets `transforms_model`: the engine then loads the whole model in full precision and calls
`transform_model(model)` before calibration and before any layer is finalized. What a technique decides while
quantizing and needs again to load its layers back (mixed precision's per-layer plan) is its `state()`, saved
with the cached quantized weights and handed back through `restore_state` on a later start.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ember_platform.engine.linear_method import UNQUANTIZED, LinearMethod, LinearSpec

if TYPE_CHECKING:
    from torch import nn

    from ember_platform.engine.calibration import CalibrationContext
    from ember_platform.engine.models.structure import ModelStructure


class QuantizationError(ValueError):
    """A quantization setting or checkpoint that cannot work, said with where and what to do."""


@dataclass(frozen=True, slots=True)
class QuantizationContext:
    """What a technique is told before the weights load."""

    structure: ModelStructure  # the family's wiring (norms -> linears, tied embeddings, rotary)
    hf_config: Mapping[str, Any]
    checkpoint_quantization: Mapping[str, Any] | None  # config.json's quantization_config, if pre-quantized
    chain: tuple[str, ...]  # every technique composed, in order (this one among them)
    position: int  # this technique's index in `chain`


class Quantizer(ABC):
    """A quantization technique, registered with `ember_quantizers` and built with its `[quantization] options`.

    Class attributes a technique may set: `needs_calibration` (the engine then loads full precision, runs the
    model on calibration text and gives `calibrate` the inputs of every linear before any layer is finalized);
    `checkpoint_format` (a config.json `quant_method` this technique loads, e.g. "compressed-tensors");
    `transforms_model` (the engine loads full precision and calls `transform_model` first, see the module docs);
    `lora_refusal` (why LoRA adapters cannot be served on weights this technique rewrote, e.g. into another basis:
    the engine then refuses every adapter with it, at start for `[[lora]]` entries and in `add_lora`).
    """

    needs_calibration: ClassVar[bool] = False
    lora_refusal: ClassVar[str | None] = None
    transforms_model: ClassVar[bool] = False
    checkpoint_format: ClassVar[str | None] = None

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    def prepare(self, context: QuantizationContext) -> None:
        """Called once before the model is built: check the checkpoint and the composition, keep what it needs.
        The default refuses a pre-quantized checkpoint (quantizing int8 weights again would be wrong)."""
        if context.checkpoint_quantization is not None and self.checkpoint_format is None:
            method = context.checkpoint_quantization.get("quant_method")
            raise QuantizationError(
                f"the checkpoint is already quantized (config.json quantization_config.quant_method = {method!r}); "
                f"quantization '{context.chain[context.position]}' quantizes full-precision weights: set "
                f"[quantization] method = \"none\" to load the checkpoint as it is")

    @abstractmethod
    def linear_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        """The method for one layer, given `inner`, the method the techniques after this one chose (the unquantized
        method when this is the last). Return `inner` to leave the layer to them (a skipped layer: lm_head)."""

    def restored_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod | None:
        """The method that loads back what this technique's layers hold once loaded (their parameters, as the
        engine's cache of quantized weights saves them), so that the next start skips quantizing; None (the
        default): not cacheable, quantize at every start."""
        return None

    def calibrate(self, calibration: CalibrationContext) -> None:  # noqa: B027 - optional
        """With `needs_calibration`: called after the full-precision load, before layers are finalized."""

    def transform_model(self, model: nn.Module) -> None:  # noqa: B027 - optional
        """With `transforms_model`: called once after the full-precision load, in chain order with the other
        techniques' `transform_model` and `calibrate` (so calibration after it sees the transformed model), before
        any layer is finalized: every linear still holds its full-precision `weight`."""

    def state(self) -> Mapping[str, Any] | None:
        """What this technique decided while quantizing (JSON-serializable), saved with the cached quantized
        weights (`quantization.json` beside them) and printed by `ember explain`; None (the default): nothing."""
        return None

    def restore_state(self, state: Mapping[str, Any]) -> None:  # noqa: B027 - optional
        """On a start that restores cached quantized weights: the `state()` saved with them, before any
        `restored_method` call."""


def method_for(chain: list[Quantizer], spec: LinearSpec) -> LinearMethod:
    """The composed method of one layer: the last technique's first, each earlier one given the result."""
    method: LinearMethod = UNQUANTIZED
    for technique in reversed(chain):
        method = technique.linear_method(spec, method)
    return method


def skipped(spec: LinearSpec, skip: tuple[str, ...]) -> bool:
    """Whether a layer is named in a skip list (an attribute name such as "lm_head", or a module prefix)."""
    parts = spec.prefix.split(".")
    return any(s in parts or spec.prefix.startswith(s + ".") or spec.prefix == s for s in skip)
