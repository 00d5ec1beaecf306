"""The native int8 linear against its torch reference: every shape (tails of K and N included), and a
row's result independent of the rows computed with it."""

from __future__ import annotations

import pytest
import torch

from ember_kernels.cpu.int8_linear import int8_linear, int8_linear_available, int8_linear_reference

pytestmark = pytest.mark.skipif(not int8_linear_available(), reason="native CPU kernels unavailable")


def operands(rows: int, out_features: int, in_features: int, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    qweight = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
    return x, qweight, scale


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 33])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (17, 688), (5, 7), (1536, 1024)])
def test_matches_the_reference(rows: int, out_features: int, in_features: int) -> None:
    x, qweight, scale = operands(rows, out_features, in_features)
    out = int8_linear(x, qweight, scale)
    assert out is not None and out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, int8_linear_reference(x, qweight, scale), rtol=1e-4, atol=1e-4)


def test_bf16_activations_are_widened() -> None:
    x, qweight, scale = operands(3, 40, 96)
    out = int8_linear(x.bfloat16(), qweight, scale)
    assert out is not None
    torch.testing.assert_close(out, int8_linear_reference(x.bfloat16(), qweight, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5])
def test_bf16_in_and_out_equal_the_float32_path_rounded(rows: int) -> None:
    # The kernel reads bf16 activations and writes bf16 outputs itself; the numbers must be exactly
    # those of widening first and rounding the float32 result after (what the model did before).
    x, qweight, scale = operands(rows, 100, 136)
    x = x.bfloat16()
    out = int8_linear(x, qweight, scale, torch.bfloat16)
    via_float = int8_linear(x.float(), qweight, scale)
    assert out is not None and via_float is not None and out.dtype == torch.bfloat16
    assert torch.equal(out, via_float.to(torch.bfloat16))
    half = int8_linear(x, qweight, scale, torch.float16)  # any other dtype: converted after the kernel
    assert half is not None and torch.equal(half, via_float.to(torch.float16))


def test_a_row_is_bitwise_the_same_in_any_batch() -> None:
    x, qweight, scale = operands(7, 72, 200)
    together = int8_linear(x, qweight, scale)
    alone = torch.cat([int8_linear(x[i:i + 1], qweight, scale) for i in range(7)])
    assert torch.equal(together, alone)


def test_mismatched_shapes_are_refused() -> None:
    x, qweight, scale = operands(2, 8, 16)
    with pytest.raises(ValueError, match="do not fit"):
        int8_linear(x[:, :8], qweight, scale)
    with pytest.raises(ValueError, match="int8 weight"):
        int8_linear(x, qweight.float(), scale)
