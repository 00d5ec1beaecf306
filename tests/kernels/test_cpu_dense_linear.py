"""The native small-batch dense linear against F.linear in float64: every shape (tails of K and N, tile
edges), with and without bias, float32 and bfloat16 weights; a row's result bit-identical whatever rows
are computed with it. (The model's Linear using it through the kernel-op table:
tests/plugins/test_kernels_plugin.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember_kernels.cpu.dense_linear import dense_linear, dense_linear_available, dense_linear_bf16

pytestmark = pytest.mark.skipif(not dense_linear_available(), reason="native CPU kernels unavailable")


def operands(rows: int, out_features: int, in_features: int, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    bias = torch.randn(out_features, generator=gen)
    return x, weight, bias


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("rows", list(range(1, 17)))
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(1, 1), (5, 7), (33, 13), (17, 688), (512, 256), (97, 1031)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    x, weight, bias = operands(rows, out_features, in_features, seed=rows)
    b = bias if with_bias else None
    out = dense_linear(x, weight, b)
    assert out is not None and out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, weight, b), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_bfloat16_weights_are_computed_in_float32(rows: int) -> None:
    x, weight, bias = operands(rows, 70, 131)
    w16 = weight.bfloat16()
    out = dense_linear(x, w16, bias)
    assert out is not None and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, w16, bias), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), [(72, 200), (4096, 256), (37, 9)])
def test_a_row_is_bitwise_the_same_in_any_batch(dtype: torch.dtype, out_features: int, in_features: int) -> None:
    x, weight, bias = operands(16, out_features, in_features)
    weight = weight.to(dtype)
    alone = [dense_linear(x[i:i + 1], weight, bias) for i in range(16)]
    for rows in range(1, 17):
        together = dense_linear(x[:rows], weight, bias)
        assert together is not None
        for i in range(rows):  # every batch size: each groups and tiles the rows differently
            assert torch.equal(together[i:i + 1], alone[i]), (rows, i)
    # and whatever the thread count (work is split by output columns, never inside a dot product)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = dense_linear(x, weight, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, dense_linear(x, weight, bias))


def test_inputs_are_converted() -> None:
    x, weight, bias = operands(3, 40, 96)
    out = dense_linear(x.t().contiguous().t(), weight, bias.double())  # non-contiguous x, float64 bias
    assert out is not None
    torch.testing.assert_close(out.double(), reference(x, weight, bias), rtol=1e-5, atol=2e-5)


def test_mismatched_shapes_are_refused() -> None:
    x, weight, bias = operands(2, 8, 16)
    with pytest.raises(ValueError, match="do not fit"):
        dense_linear(x[:, :8], weight, bias)
    with pytest.raises(ValueError, match="do not fit"):
        dense_linear(x, weight, bias[:4])
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16"):
        dense_linear(x, weight.double(), bias)
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16"):
        dense_linear(x, weight.t().contiguous().t(), bias)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("out_features", "in_features"), [(70, 131), (512, 256), (17, 688)])
def test_a_bfloat16_model_s_linear_is_the_float32_product_rounded_once(rows: int, out_features: int,
                                                                     in_features: int) -> None:
    """bf16 x and weights in, bf16 out: the float32 kernel's result on the widened inputs, rounded to bf16 as torch
    rounds (so within one bf16 rounding of the exact product), and a row's bits independent of its batch."""
    x, weight, bias = operands(rows, out_features, in_features, seed=rows)
    x16, w16 = x.bfloat16(), weight.bfloat16()
    for b in (None, bias):
        out = dense_linear_bf16(x16, w16, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        assert torch.equal(out, dense_linear(x16.float(), w16, b).bfloat16())
        exact = reference(x16.float(), w16, b)
        torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-6)
    together = dense_linear_bf16(x16, w16, bias)
    for i in range(rows):
        assert torch.equal(together[i:i + 1], dense_linear_bf16(x16[i:i + 1], w16, bias)), i
