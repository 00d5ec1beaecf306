"""Sequential calibration for GPTQ: quantize the model's linears one at a time, in the order the forward pass
reaches them, each from the inputs the already-quantized layers before it produce ("true-sequential"), so that a
layer corrects for the error of the layers upstream, and only one Hessian is held at a time.

Decoder blocks (the elements of an `nn.ModuleList`, e.g. `model.layers.3`) are handled one at a time: the model
runs up to the block (earlier blocks already quantized) and the block's inputs are kept, for every calibration
sequence; then the block alone is replayed on them, once per linear inside it: each replay accumulates the
Hessian of the next linear not yet quantized (and stops there), which is then quantized, so the next replay sees
its quantized output. Memory: one block's inputs and one Hessian. Linears outside every block (an LM head) are
calibrated last from full forward passes.

Replaying a block calls it with its captured arguments again (tensors copied: fused norms add into their
residual argument in place); a block writes its KV cache before reading it, so a replay sees the same cache.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ember_platform.api import CalibrationContext, Linear
from ember_plugins.quantization.gptq_quantize import HessianAccumulator

log = logging.getLogger("ember.gptq")

QuantizeLayer = Callable[[str, Linear, torch.Tensor], None]  # (name, layer, hessian): quantize it
LayerInput = Callable[[Linear, torch.Tensor], torch.Tensor]  # a layer's input -> what its stored weight multiplies


def _as_given(_layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return x


class _Stop(Exception):
    """Raised from a hook to end a forward pass once the inputs wanted are captured."""


def block_of(modules: dict[str, nn.Module], name: str) -> str | None:
    """The decoder block holding module `name` (`modules`: the model's named modules): its shortest prefix that
    is an element of an nn.ModuleList (a decoder layer, not an expert inside one)."""
    parts = name.split(".")
    for end in range(2, len(parts)):
        if parts[end - 1].isdigit() and isinstance(modules.get(".".join(parts[:end - 1])), nn.ModuleList):
            return ".".join(parts[:end])
    return None


def calibrate_sequentially(calibration: CalibrationContext, targets: dict[str, Linear], sequences: list[list[int]],
                           quantize: QuantizeLayer, layer_input: LayerInput = _as_given) -> None:
    """Quantize every layer of `targets` (name -> layer, not finalized, in module order) through `quantize`,
    block after block, each block's linears in the order its forward pass reaches them."""
    modules = dict(calibration.model.named_modules())
    by_block: dict[str | None, list[str]] = {}
    for name in targets:
        by_block.setdefault(block_of(modules, name), []).append(name)
    for block_name, names in by_block.items():
        if block_name is None:
            continue
        block = modules[block_name]
        replay = functools.partial(_replay, block, _block_inputs(calibration, block, sequences))
        remaining = {name: targets[name] for name in names}
        while remaining:
            name, hessian = _next_hessian(remaining, replay, layer_input)
            quantize(name, remaining.pop(name), hessian)
        del replay  # the block's inputs
    outside = {name: targets[name] for name in by_block.get(None, [])}
    while outside:  # e.g. lm_head: full passes, logits included, through the quantized model
        name, hessian = _next_hessian(outside, functools.partial(_full_passes, calibration, sequences), layer_input)
        quantize(name, outside.pop(name), hessian)


def _block_inputs(calibration: CalibrationContext, block: nn.Module,
                  sequences: list[list[int]]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The (args, kwargs) `block` is called with, for each sequence, from a forward pass stopped there."""
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append((args, kwargs))
        raise _Stop

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in sequences:
            try:
                calibration.run(ids)
            except _Stop:
                continue
            raise RuntimeError("gptq: the forward pass never reached a decoder block it holds linears of")
    finally:
        handle.remove()
    return captured


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _replay(block: nn.Module, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
    with torch.inference_mode():
        for args, kwargs in inputs:
            try:
                block(*(_copied(a) for a in args), **{k: _copied(v) for k, v in kwargs.items()})
            except _Stop:
                continue


def _full_passes(calibration: CalibrationContext, sequences: list[list[int]]) -> None:
    with torch.inference_mode():
        for ids in sequences:
            try:
                calibration.model.compute_logits(calibration.run(ids))
            except _Stop:
                continue


def _next_hessian(remaining: dict[str, Linear], run: Callable[[], None],
                  layer_input: LayerInput) -> tuple[str, torch.Tensor]:
    """Run `run` once with hooks on the remaining layers; the first one the forward pass reaches is the next to
    quantize, and its Hessian is accumulated over the whole run."""
    first: list[str] = []
    accumulator: list[HessianAccumulator] = []
    handles = []
    for name, layer in remaining.items():
        def hook(_module: nn.Module, args: tuple[Any, ...], _name: str = name, _layer: Linear = layer) -> None:
            if not first:
                first.append(_name)
                accumulator.append(HessianAccumulator(_layer.in_features, args[0].device))
            if first[0] == _name:
                accumulator[0].add(layer_input(_layer, args[0]))
                raise _Stop  # nothing after this layer is needed for its Hessian: end the pass here
        handles.append(layer.register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    if not first:
        raise RuntimeError(f"gptq: no calibration input reached {', '.join(remaining)}")
    log.debug("gptq: %s from %d input rows", first[0], accumulator[0].num_rows)
    return first[0], accumulator[0].hessian()
