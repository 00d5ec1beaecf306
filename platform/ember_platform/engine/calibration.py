"""The calibration context given to quantizers that ask for one (`Quantizer.needs_calibration`): the tokenizer,
calibration text, and `capture()`, which runs the loaded full-precision model on that text and returns the input
activations of every linear layer.

The text is the package's `calibration.txt` when it has one, else a small offline corpus shipped with the
platform (`data/calibration.txt`: prose, questions, code, SQL, JSON, a few languages), so that calibration needs
no network and gives the same result on every machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ember_platform.engine.attention import AttentionMetadata, kv_cache_block_shape
from ember_platform.engine.linear_method import linear_modules

if TYPE_CHECKING:
    from ember_platform.engine.text.tokenizer import Tokenizer

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "calibration.txt"
PACKAGE_FILE = "calibration.txt"
CALIBRATION_ENV = "EMBER_CALIBRATION_FILE"
BLOCK_SIZE = 16


def calibration_text(package_root: Path | None) -> tuple[str, Path]:
    """(text, where it came from): the file $EMBER_CALIBRATION_FILE names (`ember quantize --calibration`), else
    the package's calibration.txt, else the default corpus."""
    override = os.environ.get(CALIBRATION_ENV)
    if override:
        path = Path(override)
        return path.read_text(encoding="utf-8"), path
    path = package_root / PACKAGE_FILE if package_root is not None else None
    if path is None or not path.is_file():
        path = DEFAULT_CORPUS
    return path.read_text(encoding="utf-8"), path


@dataclass
class CalibrationContext:
    """Calibration data and the model to run it on. `capture` is cached: techniques composed together share it."""

    model: nn.Module
    tokenizer: Tokenizer
    text: str
    source: Path  # the file the text came from
    max_tokens: int = 512  # calibration tokens run through the model, in sequences of `sequence_length`
    sequence_length: int = 128
    _captured: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def token_sequences(self) -> list[list[int]]:
        """The calibration text as token id sequences (the first `max_tokens` tokens, cut in sequences)."""
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)[: self.max_tokens]
        return [ids[i:i + self.sequence_length] for i in range(0, len(ids), self.sequence_length)]

    def run(self, ids: list[int]) -> torch.Tensor:
        """One prefill of a token sequence through the model as it is now (layers finalized so far compute
        quantized): hidden states [T, D]. For techniques that calibrate layer after layer on the outputs of the
        layers they already quantized (gptq), where `capture`'s one full-precision run is not enough."""
        with torch.inference_mode():
            return run_prefill(self.model, ids)

    def capture(self, layers: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The inputs of each linear layer (by module name; `layers` None: all) over every calibration token,
        [num_tokens, in_features] in the model's dtype, from one run of the full-precision model."""
        if self._captured is None:
            self._captured = capture_linear_inputs(self.model, self.token_sequences())
        wanted = self._captured if layers is None else {name: self._captured[name] for name in layers}
        return dict(wanted)


    def logits(self) -> list[torch.Tensor]:
        """The model's float32 logits [len, vocab] on each calibration sequence, as it computes now (layers not
        finalized compute with their full-precision weights): what a technique measures a layer's sensitivity with,
        by changing that layer's weight and calling this again."""
        with torch.inference_mode():
            return [self.model.compute_logits(run_prefill(self.model, ids)).float() for ids in self.token_sequences()]

    def loss(self) -> float:
        """The model's mean next-token cross-entropy (nats) over the calibration sequences, as it computes now."""
        total, count = 0.0, 0
        for ids, logits in zip(self.token_sequences(), self.logits(), strict=True):
            if len(ids) < 2:
                continue
            target = torch.tensor(ids[1:], device=logits.device)
            total += float(torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum"))
            count += len(ids) - 1
        if not count:
            raise ValueError(f"{self.source}: the calibration text is too short to measure a loss on")
        return total / count


def run_prefill(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """One forward pass of a sequence through `model` (a fresh KV cache of its own); returns hidden states [T, D]."""
    args, device = model.args, model.device
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    shape = (num_blocks, *kv_cache_block_shape(BLOCK_SIZE, args.num_kv_heads, args.head_dim))
    kv_caches = [(torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype,
                                                                                     device=device))
                 for _ in range(args.num_layers)]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], BLOCK_SIZE, device)
    tokens = torch.tensor(ids, device=device)
    return model(tokens, torch.arange(len(ids), device=device), meta, kv_caches)


def capture_linear_inputs(model: nn.Module, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """Run every sequence through `model` and collect each `Linear`'s input rows, concatenated in order."""
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name, _ in linear_modules(model)}
    handles = []
    for name, layer in linear_modules(model):
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], _name: str = name) -> None:
            inputs[_name].append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())
        handles.append(layer.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            for ids in sequences:
                hidden = run_prefill(model, ids)
                model.compute_logits(hidden)
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(rows) for name, rows in inputs.items() if rows}
