"""The quantizer interface (documented engine API for quantization plugins).

A quantizer is applied once, after the weights are loaded and before warm-up: it replaces the
model's linear layers by its own modules. It may also serialize its result, so that the next
cold start can skip quantizing (`state_dict` of the quantized model is what gets cached).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn


class Quantizer(ABC):
    """Turns a loaded model's linear layers into quantized ones. Registered with `ember_quantizers`."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    @abstractmethod
    def quantize(self, model: nn.Module) -> nn.Module:
        """Quantize in place (or return a new module); called once per replica."""

    def restore(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module | None:
        """Rebuild what `quantize` made from its saved `state_dict()`, without quantizing again: the engine's
        cold-start cache of quantized weights. `model` is freshly built on the meta device (no weights); put the
        quantized modules in place from `state`; the engine then materializes and fills the other parameters
        from `state` too. Return None (the default) when this quantizer cannot: it then quantizes every time."""
        return None


def linear_layers(model: nn.Module, skip: tuple[str, ...] = ()) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, layer) for every nn.Linear not under a name in `skip`."""
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and not any(part in skip for part in full.split(".")):
                yield module, child_name, child
