"""Loading a model through its quantization techniques: pick every layer's `LinearMethod` on the meta device,
stream the checkpoint through them (each layer quantized as soon as it is complete), or restore the quantized
weights an earlier start cached.

The chain of techniques comes from the selection (`[quantization] method`, one name or several composed in
order, joined "a+b" in the selection's name) or, for a pre-quantized checkpoint, from config.json's
`quantization_config.quant_method`, which names the technique that reads its layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ember_platform.engine.calibration import CalibrationContext, calibration_text
from ember_platform.engine.linear_method import (
    UNQUANTIZED,
    LinearMethod,
    LinearSpec,
    finish_loading,
    set_linear_methods,
)
from ember_platform.engine.models.loader import load_weights
from ember_platform.engine.packaged_quantized import entry_states, find_entry
from ember_platform.engine.quantization import QuantizationContext, QuantizationError, Quantizer, method_for
from ember_platform.engine.quantized_cache import QuantizedWeightCache
from ember_platform.kvtiers.identity import model_identity

if TYPE_CHECKING:
    from ember.plugins import PluginHost
    from ember.selection import SelectionReport
    from ember_platform.engine.config import ModelSource

log = logging.getLogger("ember.engine")

NONE = "none"
CHAIN_SEPARATOR = "+"


def chain_names(name: str) -> tuple[str, ...]:
    """The techniques a quantization selection composes, in order ("none": no technique)."""
    return () if name == NONE else tuple(name.split(CHAIN_SEPARATOR))


@dataclass(frozen=True, slots=True)
class QuantizedLoad:
    """What `load_quantized` did."""

    chain: tuple[str, ...]  # the techniques applied, in order (empty: full precision)
    timings: dict[str, float]  # "load" (all of it) and "quantize" (the layers' after_loading, part of "load")
    from_cache: bool
    layer_methods: dict[str, str]  # layer name -> its method, for the layers not left full precision
    lora_refusal: str | None = None  # why adapters cannot apply to these weights (`Quantizer.lora_refusal`)
    states: dict[str, Any] = field(default_factory=dict)  # technique -> what it decided (`Quantizer.state()`)


def resolve_chain(selection: SelectionReport, plugins: PluginHost,
                  hf_config: Mapping[str, Any]) -> list[tuple[str, type[Quantizer], dict[str, Any]]]:
    """(name, technique class, options) of each technique to apply, in order."""
    names = chain_names(selection.name)
    checkpoint = hf_config.get("quantization_config")
    if checkpoint is not None and not names:
        method = checkpoint.get("quant_method")
        if not isinstance(method, str):
            raise QuantizationError("config.json: quantization_config has no 'quant_method' string")
        names = (method,)
    options = dict(selection.options)
    chain = []
    for name in names:
        technique = plugins.techniques.get("quantization", name)
        if technique is None:
            where = ("config.json quantization_config.quant_method" if selection.name == NONE
                     else "[quantization] method")
            available = ", ".join(sorted(plugins.techniques.of_kind("quantization"))) or "none"
            raise QuantizationError(f"{where} = {name!r}: no installed plugin provides quantization '{name}' "
                                    f"(installed: {available})")
        cls = technique.load()
        if not (isinstance(cls, type) and issubclass(cls, Quantizer)):
            raise QuantizationError(f"quantization '{name}' is {cls!r}, which is not a Quantizer subclass "
                                    "(ember_platform.api.Quantizer): its plugin registered something else")
        own = options.get(name, {}) if len(names) > 1 else options
        if len(names) > 1 and not isinstance(own, Mapping):
            raise QuantizationError(f"[quantization] options.{name}: with several methods, options are tables "
                                    f"keyed by method name, got {own!r}")
        unread = sorted(set(own) - set(technique.options)) if len(names) > 1 else []
        if unread:  # one technique's own table (the manifest check covers a single technique's options)
            reads = f"reads only {', '.join(technique.options)}" if technique.options else "reads no options"
            raise QuantizationError(f"[quantization] options.{name}.{unread[0]}: not supported by quantization "
                                    f"'{name}', which {reads}")
        chain.append((name, cls, dict(own)))
    return chain


def load_quantized(model: nn.Module, build: Callable[[], nn.Module], *, source: ModelSource,
                   hf_config: Mapping[str, Any], selection: SelectionReport, plugins: PluginHost,
                   dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, QuantizedLoad]:
    """Load `model` (built on meta by `build`, which makes a fresh one) through its quantization chain."""
    t0 = time.perf_counter()
    resolved = resolve_chain(selection, plugins, hf_config)
    if not resolved:
        load_weights(model, source.weights_dir)
        return model, QuantizedLoad((), {"load": time.perf_counter() - t0}, False, {})
    names = tuple(name for name, _, _ in resolved)
    chain = [cls(options) for _, cls, options in resolved]
    structure = model.structure()
    checkpoint = hf_config.get("quantization_config")
    for i, technique in enumerate(chain):
        technique.prepare(QuantizationContext(structure, hf_config, checkpoint, names, i))
    refusal = next((f"[quantization] method '{name}': {t.lora_refusal}" for name, t in zip(names, chain, strict=True)
                    if t.lora_refusal), None)

    # Quantized weights the package ships (`ember quantize`), then the engine's own cache of an earlier start.
    shipped = (find_entry(source.root, source.weights_dir, selection.name, selection.options, dtype)
               if checkpoint is None and source.is_package else None)
    if shipped is not None and _restored_factory(chain) is not None:
        try:
            states = entry_states(shipped)  # what the techniques decided (rotation's seed, mixed's plan)
            _restore_states(chain, names, {"techniques": states})
            methods = set_linear_methods(model, _restored_factory(chain), dtype)
            load_weights(model, shipped)
            log.info("quantized weights loaded from the package: %s", shipped)
            return model, QuantizedLoad(names, {"load": time.perf_counter() - t0, "quantize": 0.0}, True, methods,
                                        refusal, states)
        except (OSError, ValueError) as e:  # QuantizationError is a ValueError
            log.warning("the package's quantized weights %s do not load (%s); quantizing at start", shipped, e)
            model = build()
    cache = QuantizedWeightCache.default() if checkpoint is None else None  # a pre-quantized load has no cost
    key = None
    if cache is not None:
        identity = model_identity(source.weights_dir, source.root if source.is_package else None)
        key = cache.key(identity, selection.name, selection.options, dtype, device, [cls for _, cls, _ in resolved])
        entry = cache.lookup(key)
        restored = _restored_factory(chain) if entry is not None else None
        if entry is not None and restored is not None:
            try:
                saved = cache.state(key)
                _restore_states(chain, names, saved)
                methods = set_linear_methods(model, restored, dtype)
                load_weights(model, entry)
                log.info("quantized weights restored from the cache: %s", entry)
                return model, QuantizedLoad(names, {"load": time.perf_counter() - t0, "quantize": 0.0}, True,
                                            methods, refusal, dict(saved.get("techniques", {})))
            except (OSError, ValueError) as e:  # QuantizationError is a ValueError
                log.warning("quantized-weight cache entry %s is unreadable (%s); quantizing again", entry, e)
                cache.discard(key)
                model = build()

    methods = set_linear_methods(model, lambda spec: method_for(chain, spec), dtype)
    # A technique that calibrates or transforms the whole model needs every layer loaded in full precision first.
    deferred = any(t.needs_calibration or t.transforms_model for t in chain)
    loaded = load_weights(model, source.weights_dir, finalize=not deferred)
    quantize_s = loaded.finalize_s
    if deferred:
        t1 = time.perf_counter()
        calibration: CalibrationContext | None = None
        for technique in chain:  # in chain order: a calibration after a transform sees the transformed model
            if technique.transforms_model:
                technique.transform_model(model)
            if technique.needs_calibration:
                if calibration is None:
                    from ember_platform.engine.text.tokenizer import Tokenizer

                    text, where = calibration_text(source.root if source.is_package else None)
                    calibration = CalibrationContext(model, Tokenizer.from_dir(source.weights_dir), text, where)
                technique.calibrate(calibration)
        finish_loading(model)
        quantize_s += time.perf_counter() - t1
    state = _saved_state(chain, names, source, selection)
    if cache is not None and key is not None:
        if _restored_factory(chain) is not None:
            cache.save(key, model, state)
        elif state["techniques"]:  # not restorable, but what was decided is kept for `ember explain`
            cache.save_state(key, state)
    return model, QuantizedLoad(names, {"load": time.perf_counter() - t0, "quantize": quantize_s}, False, methods,
                                refusal, state["techniques"])


def _saved_state(chain: list[Quantizer], names: tuple[str, ...], source: ModelSource,
                 selection: SelectionReport) -> dict[str, Any]:
    """`quantization.json` of a cache entry: what each technique decided (`state()`), and for whom (the weights'
    directory and the selection, which `ember explain` matches a package against)."""
    techniques = {name: dict(state) for name, t in zip(names, chain, strict=True) if (state := t.state()) is not None}
    return {"weights_dir": str(source.weights_dir.resolve()), "selection": selection.name,
            "options": dict(selection.options), "techniques": techniques}


def _restore_states(chain: list[Quantizer], names: tuple[str, ...], saved: Mapping[str, Any]) -> None:
    """Give each technique that keeps a state the one saved with the cache entry (ValueError: none was saved)."""
    states = saved.get("techniques", {})
    for name, technique in zip(names, chain, strict=True):
        if type(technique).restore_state is Quantizer.restore_state:
            continue  # keeps no state
        if not isinstance(states.get(name), Mapping):
            raise ValueError(f"the entry has no saved state for quantization '{name}'")
        technique.restore_state(states[name])


def _restored_factory(chain: list[Quantizer]) -> Callable[[LinearSpec], LinearMethod] | None:
    """The factory of the methods that load a cache entry back, or None when a technique cannot restore."""
    if any(type(t).restored_method is Quantizer.restored_method for t in chain):
        return None  # a technique that does not say how to load what it made back

    def factory(spec: LinearSpec) -> LinearMethod:
        method: LinearMethod = UNQUANTIZED
        for technique in reversed(chain):
            restored = technique.restored_method(spec, method)
            if restored is None:
                raise QuantizationError(f"{spec.prefix}: quantization cannot restore this layer from the cache")
            method = restored
        return method

    return factory
