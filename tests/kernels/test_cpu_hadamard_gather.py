"""The native online Hadamard rotation (hadamard.c) against the torch formula of `RandomHadamard.rotate`, and the
native column gather (fused_ops.c) that act-order int4 layers read their inputs through."""

from __future__ import annotations

import pytest
import torch

from ember_kernels.cpu.build import native_library
from ember_kernels.cpu.fused_ops import gather_columns
from ember_kernels.cpu.hadamard import hadamard_rotate
from ember_plugins.quantization import hadamard as hadamard_module
from ember_plugins.quantization.hadamard import RandomHadamard

pytestmark = pytest.mark.skipif(native_library() is None, reason="native CPU kernels unavailable")


def rotated(rotation: RandomHadamard, x: torch.Tensor) -> torch.Tensor | None:
    signs, _, rt = rotation._factors(x.device, torch.float32)
    return hadamard_rotate(x, signs, rt if rotation.r is not None else None, rotation.m, rotation.p)


# Sizes: powers of two (m = 1), llama-150m's 2816 = 11 * 256, p below the 8 lanes (12 = 3 * 4), p = 8 (24),
# tiny-llama's 688 = 43 * 16 (m above what the plugin hands the kernel, still computed right).
@pytest.mark.parametrize("n", [8, 64, 1024, 2816, 12, 24, 688])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_the_native_rotation_is_the_float32_formula(n: int, rows: int) -> None:
    rotation = RandomHadamard(n, seed=7)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n + rows)) * 3
    exact = rotation.rotate(x.double())
    y = rotated(rotation, x)
    assert y is not None and y.dtype == torch.float32 and y.shape == x.shape
    # float32 arithmetic in another summation order than torch's: within a few float32 ulps of the exact rotation.
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=float(exact.abs().max()) * 1e-6)
    assert not torch.equal(y, x)  # a rotation that did nothing would pass nothing else here either


@pytest.mark.parametrize("n", [1024, 2816])
def test_bfloat16_is_rotated_in_float32_and_rounded_once(n: int) -> None:
    rotation = RandomHadamard(n, seed=3)
    x = torch.randn(9, n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = rotated(rotation, x)
    reference = rotation.rotate(x.float()).to(torch.bfloat16)
    assert y is not None and y.dtype == torch.bfloat16
    # Each output rounds a float32 value that differs from the reference's by a few ulps: at most one bf16 step apart.
    step = reference.float().abs() * 2.0**-7 + 1e-30
    assert bool(((y.float() - reference.float()).abs() <= step).all())
    assert (y == reference).float().mean() > 0.95


def test_leading_dimensions_and_threads_do_not_change_a_row() -> None:
    rotation = RandomHadamard(2816, seed=5)
    x = torch.randn(2, 40, 2816, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    together = rotated(rotation, x)
    torch.set_num_threads(1)
    try:
        alone = rotated(rotation, x[1, 7:8])
    finally:
        torch.set_num_threads(threads)
    assert together is not None and alone is not None and together.shape == x.shape
    assert torch.equal(together[1, 7:8], alone)


def test_sizes_the_kernel_does_not_take_are_refused() -> None:
    rotation = RandomHadamard(64, seed=1)
    signs, _, _ = rotation._factors(torch.device("cpu"), torch.float32)
    assert hadamard_rotate(torch.randn(2, 63), signs, None, 1, 64) is None  # rows of another size
    assert hadamard_rotate(torch.randn(2, 64).half(), signs, None, 1, 64) is None  # a dtype it does not compute
    assert hadamard_rotate(torch.randn(2, 64), signs, None, 2, 32) is None  # m > 1 without R_m
    assert hadamard_rotate(torch.randn(2, 64), signs.double(), None, 1, 64) is None


def test_the_online_rotation_runs_the_kernel_where_it_is_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    def spy(x: torch.Tensor, signs: torch.Tensor, rt: torch.Tensor | None, m: int, p: int) -> torch.Tensor | None:
        calls.append((m, p))
        return hadamard_rotate(x, signs, rt, m, p)

    monkeypatch.setattr(hadamard_module, "hadamard_rotate", spy)
    x = torch.randn(4, 2816, dtype=torch.bfloat16)
    rotation = RandomHadamard(2816, seed=0)
    y = rotation.rotate_activations(x)
    assert calls == [(11, 256)]
    torch.testing.assert_close(y.float(), rotation.rotate(x.float()), rtol=0.02, atol=0.02)
    RandomHadamard(688, seed=0).rotate_activations(torch.randn(4, 688))  # m = 43: torch's batched matmul
    assert calls == [(11, 256)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
@pytest.mark.parametrize("rows", [0, 1, 3, 300])
def test_gather_columns_is_index_select(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 1000, generator=g) * 100).to(dtype)
    order = torch.randperm(1000, generator=g).to(torch.int32)
    out = gather_columns(x, order)
    assert out is not None and torch.equal(out, x.index_select(1, order.long()))


def test_gather_columns_refuses_what_it_cannot_read() -> None:
    x = torch.randn(4, 16)
    order = torch.arange(16, dtype=torch.int32)
    assert gather_columns(x.t(), order) is None  # not contiguous
    assert gather_columns(x, order.long()) is None  # int64 order
    assert gather_columns(x, order[:8]) is None  # an order of another length
    assert gather_columns(x.double(), order) is None  # 8-byte elements
