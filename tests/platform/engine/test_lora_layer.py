"""The batched multi-LoRA matmul against its per-token definition, on packed and plain layers."""

from __future__ import annotations

import pytest
import torch

from ember_platform.engine.lora_layer import LoRALayout, LoRAStep, add_lora


def reference_delta(x: torch.Tensor, token_slots: list[int], layout: LoRALayout,
                    adapters: list[list[tuple[torch.Tensor, torch.Tensor]] | None]) -> torch.Tensor:
    """y[t, slice j] = (x[t] A_j^T) B_j^T of the token's adapter, one token and one slice at a time."""
    delta = torch.zeros(x.shape[0], layout.out_features, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for (_, offset, size), (a, b) in zip(layout.slices, adapters[slot], strict=True):
            delta[t, offset:offset + size] = (x[t].double() @ a.double().T) @ b.double().T
    return delta


def stacks(layout: LoRALayout, adapters: list[list[tuple[torch.Tensor, torch.Tensor]] | None], num_slots: int,
           rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The manager's layout: A [S, n, R, in], B^T per slice [S, R, size], zero-padded to rank R."""
    a_stack = torch.zeros(num_slots, len(layout.slices), rank, layout.in_features)
    b_stacks = [torch.zeros(num_slots, rank, size) for _, _, size in layout.slices]
    for slot, adapter in enumerate(adapters):
        for j, (a, b) in enumerate(adapter or []):
            a_stack[slot, j, :a.shape[0]] = a
            b_stacks[j][slot, :a.shape[0]] = b.T
    return a_stack, b_stacks


@pytest.mark.parametrize("slice_sizes", [(8, 4, 4), (12,)], ids=["packed-qkv", "plain"])
def test_add_lora_matches_per_token_reference(slice_sizes: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    in_features, num_slots, max_rank = 16, 4, 6
    offsets = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
    layout = LoRALayout(in_features, tuple((i, o, s) for i, (o, s) in enumerate(zip(offsets, slice_sizes,
                                                                                      strict=True))))
    # slot 0: rank 2, slot 1: rank 6 (the padded rank), slot 2: empty, slot 3: rank 3 (not used this step)
    ranks = [2, max_rank, None, 3]
    adapters = [None if r is None else [(torch.randn(r, in_features, generator=gen),
                                         torch.randn(size, r, generator=gen)) for size in slice_sizes]
                for r in ranks]
    a_stack, b_stacks = stacks(layout, adapters, num_slots, max_rank)
    token_slots = [0, 0, -1, 1, 1, 1, -1, 0, 1]  # three requests' tokens (and two without adapter)
    x = torch.randn(len(token_slots), in_features, generator=gen)
    base = torch.randn(len(token_slots), layout.out_features, generator=gen)
    step = LoRAStep(torch.tensor(token_slots), num_slots=2, dtype=torch.float32)  # slots [0, 2) are in use
    y = add_lora(base.clone(), x, a_stack, b_stacks, layout, step)
    expected = base.double() + reference_delta(x, token_slots, layout, adapters)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    # A token without adapter comes out bit-identical to the base layer's output.
    assert torch.equal(y[2], base[2]) and torch.equal(y[6], base[6])
