"""The batched multi-LoRA matmul: one layer serves every resident adapter (and none) in the same batch.

Layout (one `LoRALinear` per layer that can carry an adapter; S device slots, R the padded rank):

    lora_a:    [S, n, R, in]        A of each slot, for each of the layer's n output slices (q/k/v, gate/up)
    lora_b[j]: [S, R, size_j]       B^T of each slot for output slice j, pre-multiplied by the adapter's scaling

An adapter of rank r < R fills rows/columns [:r] and leaves zeros, which add exactly nothing. Each step the
model runner builds one `LoRAStep` (a [T, S'] one-hot token -> slot mask over the first S' slots, S' = the
highest slot the step uses + 1; a token of a request without adapter has an all-zero row) that every layer
reuses. A layer then computes, for all tokens at once,

    h = x @ A_all^T                      [T, S'*n*R]  one GEMM over every slot's A
    h *= mask                            keep each token's own slot; other slots' columns become 0
    y[:, slice j] += h_j @ B_all,j       [T, S'*R] x [S'*R, size_j]: one GEMM per output slice

so the work grows with the number of distinct adapters in the step (bounded by the slot budget), never with
the number of requests, and there is no gather of weights per token (Punica's BGMV) nor a host sync.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ember_platform.engine.linear_method import Linear


@dataclass(frozen=True, slots=True)
class LoRALayout:
    """Where a LoRA attaches to one layer: its input size and output slices (the layer's shards)."""

    in_features: int
    slices: tuple[tuple[Hashable | None, int, int], ...]  # (shard id, output offset, size), in output order

    @property
    def out_features(self) -> int:
        return sum(size for _, _, size in self.slices)

    def slice_index(self, shard_id: Hashable | None) -> int | None:
        for i, (sid, _, _) in enumerate(self.slices):
            if sid == shard_id:
                return i
        return None


def lora_layouts(model: nn.Module, module_names: Iterable[str]) -> dict[str, LoRALayout]:
    """The layout of every linear layer whose attribute name is in `module_names` (e.g. "qkv_proj")."""
    wanted = set(module_names)
    out: dict[str, LoRALayout] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in wanted or not isinstance(module, Linear):
            continue
        slices = tuple((sid, module.shard_offsets[sid], size) for sid, size in module.shard_sizes.items())
        out[name] = LoRALayout(module.in_features, slices)
    return out


class LoRAStep:
    """One step's token -> adapter slot assignment, built once by the model runner, read by every layer."""

    __slots__ = ("mask", "num_slots")

    def __init__(self, token_slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> None:
        # token_slots: [T] long, -1 = no adapter. mask: [T, num_slots], 1 in the token's slot column.
        self.num_slots = num_slots
        arange = torch.arange(num_slots, device=token_slots.device)
        self.mask = (token_slots[:, None] == arange[None, :]).to(dtype)


class LoRAContext:
    """Shared by the manager, the runner and every `LoRALinear`: the step being run (None = no adapter in it).

    An object passed by reference instead of an extra forward argument, because the modules between the
    model and its linears (and a quantizer's replacements) know nothing about adapters."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRALinear(nn.Module):
    """y = base(x) + the LoRA delta of each token's adapter. `base` is whatever module sat at this position
    after loading (a `Linear`, whatever its method)."""

    def __init__(self, base: nn.Module, layout: LoRALayout, context: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.layout = layout
        self.context = context
        # Plain attributes, not buffers: the LoRA manager owns (allocates, grows, fills) them, and the model's
        # state_dict stays the base model's.
        self.lora_a: torch.Tensor | None = None  # [S, n, R, in]
        self.lora_b: list[torch.Tensor] = []  # per output slice: [S, R, size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.context.step
        if step is None or self.lora_a is None:
            return y
        return add_lora(y, x, self.lora_a, self.lora_b, self.layout, step)

    def extra_repr(self) -> str:
        slots = 0 if self.lora_a is None else self.lora_a.shape[0]
        rank = 0 if self.lora_a is None else self.lora_a.shape[2]
        return f"slices={len(self.layout.slices)}, slots={slots}, rank={rank}"


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: list[torch.Tensor],
             layout: LoRALayout, step: LoRAStep) -> torch.Tensor:
    """y += each token's (x A_slot^T) B_slot^T, in place; see the module docstring for the layout."""
    # x: [..., in]; y: [..., out]
    num_slots, num_slices, rank = step.num_slots, lora_a.shape[1], lora_a.shape[2]
    x2 = x.reshape(-1, layout.in_features)
    y2 = y.view(-1, layout.out_features)
    num_tokens = x2.shape[0]
    a = lora_a[:num_slots].reshape(num_slots * num_slices * rank, layout.in_features)  # a prefix: a view
    h = (x2 @ a.T).view(num_tokens, num_slots, num_slices * rank)  # shrink, every slot at once
    h.mul_(step.mask[:, :, None].to(h.dtype))
    if num_slices == 1:
        y2.addmm_(h.view(num_tokens, num_slots * rank), lora_b[0][:num_slots].reshape(num_slots * rank, -1))
        return y
    h = h.view(num_tokens, num_slots, num_slices, rank)
    for j, (_, offset, size) in enumerate(layout.slices):
        hj = h[:, :, j].reshape(num_tokens, num_slots * rank)
        y2.narrow(-1, offset, size).addmm_(hj, lora_b[j][:num_slots].reshape(num_slots * rank, size))
    return y

