"""`bf16_gemm` (AVX512_BF16 dot products on widened int8 / e4m3 weight tiles) against the float32 reference: both
weight kinds, every e4m3 code, shapes with tails (outputs not a multiple of the 12-row tile, odd inputs, rows
not a multiple of 16 or 32), bf16 and float32 out, row counts on both sides of the fp8 layer's threshold, and a
row's result bit for bit the same in any batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ember_kernels.cpu.quantized_linear import bf16_gemm, bf16_gemm_available, quantized_linear_reference
from ember_plugins.quantization.fp8 import TILED_THRESHOLD

Operands = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # the `operands` fixture (conftest.py)
pytestmark = pytest.mark.skipif(not bf16_gemm_available(), reason="no AVX512_BF16 native kernels here")
BF16_THRESHOLD = TILED_THRESHOLD[torch.bfloat16]



@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [1, 3, BF16_THRESHOLD, BF16_THRESHOLD + 1, 16, 17, 32, 33, 70])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (37, 203), (5, 1), (100, 1024)])
def test_matches_the_reference(kind: torch.dtype, rows: int, out_features: int, in_features: int,
                               operands: Operands) -> None:
    x, qweight, scale = operands(rows, out_features, in_features, kind)
    out = bf16_gemm(x, qweight, scale, torch.float32)
    expected = quantized_linear_reference(x, qweight, scale)
    assert out is not None and out.shape == (rows, out_features) and out.dtype == torch.float32
    # The weights are widened exactly and every product is exact in float32: only the order of the sums differs.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_reads_every_e4m3_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)  # the NaN codes out
    qweight = codes.view(torch.float8_e4m3fn).reshape(16, 16).repeat(1, 3)[:, :45].contiguous()
    x = torch.randn(20, 45).bfloat16()
    scale = torch.ones(16)
    out = bf16_gemm(x, qweight, scale, torch.float32)
    assert out is not None
    torch.testing.assert_close(out, quantized_linear_reference(x, qweight, scale), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
def test_bf16_out_is_the_float32_result_rounded(kind: torch.dtype, operands: Operands) -> None:
    x, qweight, scale = operands(40, 37, 203, kind)
    x[2, 0] = float("nan")  # a NaN row stays NaN
    out = bf16_gemm(x, qweight, scale, torch.bfloat16)
    via_float = bf16_gemm(x, qweight, scale, torch.float32)
    assert out is not None and via_float is not None and out.dtype == torch.bfloat16
    finite = [i for i in range(40) if i != 2]
    assert torch.equal(out[finite].view(torch.int16), via_float[finite].to(torch.bfloat16).view(torch.int16))
    assert bool(torch.isnan(out[2]).all())


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
def test_a_row_is_bitwise_the_same_in_any_batch(kind: torch.dtype, operands: Operands) -> None:
    x, qweight, scale = operands(70, 29, 133, kind)
    x[1] *= 1000
    together = bf16_gemm(x, qweight, scale, torch.float32)
    assert together is not None
    for rows in (1, 2, 5, 16, 17, 33):
        assert torch.equal(bf16_gemm(x[:rows], qweight, scale, torch.float32), together[:rows])
        assert torch.equal(bf16_gemm(x[rows:rows + 1], qweight, scale, torch.float32), together[rows:rows + 1])


def test_float32_activations_are_left_to_the_other_paths(operands: Operands) -> None:
    x, qweight, scale = operands(8, 16, 32, torch.float8_e4m3fn)
    assert bf16_gemm(x.float(), qweight, scale) is None  # rounding them to bf16 would change the map
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        bf16_gemm(x, qweight.float(), scale)
    with pytest.raises(ValueError, match="do not fit"):
        bf16_gemm(x[:, :8], qweight, scale)


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
def test_rows_across_the_kernels_blocks_of_rows_are_each_their_own(kind: torch.dtype, operands: Operands) -> None:
    # 1,000 rows of 1,030 inputs: blocks of 352 rows of x kept in L2 (BG_X_BYTES), the last one partial; every row the
    # same as alone, in float32 and bf16, and the whole within the reference's rounding.
    x, qweight, scale = operands(1000, 37, 1030, kind)
    for out_dtype in (torch.float32, torch.bfloat16):
        together = bf16_gemm(x, qweight, scale, out_dtype)
        assert together is not None
        for row in (0, 351, 352, 353, 703, 704, 999):
            assert torch.equal(bf16_gemm(x[row:row + 1], qweight, scale, out_dtype), together[row:row + 1])
    expected = quantized_linear_reference(x, qweight, scale)
    out = bf16_gemm(x, qweight, scale, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
