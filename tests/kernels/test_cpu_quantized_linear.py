"""The native fp8 linear, the exact widening of int8 / e4m3 weights, the tiled GEMM path and the int8 GEMM path
against their torch references: every e4m3 code, shapes with tails, bf16 in and out, and a row's result
independent of the rows computed with it."""

from __future__ import annotations

import pytest
import torch

import ember_kernels.cpu.quantized_linear as ql
from ember_kernels.cpu.quantized_linear import (
    fp8_linear,
    fp8_linear_available,
    int8_gemm,
    int8_gemm_reference,
    quantized_linear_reference,
    tiled_linear,
    widen_weights,
)

pytestmark = pytest.mark.skipif(not fp8_linear_available(), reason="native CPU kernels unavailable")


def fp8_operands(rows: int, out_features: int, in_features: int, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    # Values across e4m3's whole range, subnormals (below 2^-6) included.
    w = torch.randn(out_features, in_features, generator=gen) * torch.exp2(torch.randint(-10, 8, (1,),
                                                                                          generator=gen).float())
    qweight = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
    return x, qweight, scale


def all_e4m3_codes(repeats: int = 1) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).repeat(repeats).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("repeats", [1, 41])  # 256 codes (one vector span), and 10,496 (several, with a tail)
def test_every_e4m3_code_widens_to_torchs_value(dtype: torch.dtype, repeats: int) -> None:
    codes = all_e4m3_codes(repeats)
    out = torch.empty(codes.numel(), dtype=dtype)
    assert widen_weights(codes, out)
    expected = codes.float()
    finite = ~torch.isnan(expected)  # 0x7f and 0xff: NaN, which quantizers never store
    assert torch.equal(out.float()[finite], expected[finite])


def test_int8_widens_exactly_into_bfloat16() -> None:
    q = torch.randint(-128, 128, (37, 203), dtype=torch.int8)
    out = torch.empty(37, 203, dtype=torch.bfloat16)
    assert widen_weights(q, out) and torch.equal(out.float(), q.float())


def test_fp8_linear_reads_every_code() -> None:
    # One weight row per code: the kernel's in-register decoding (vector lanes and scalar tail) on all of them.
    codes = all_e4m3_codes().view(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)  # NaN codes out
    qweight = codes.view(torch.float8_e4m3fn).reshape(16, 16).repeat(1, 3)[:, :45].contiguous()
    x = torch.randn(3, 45)
    scale = torch.ones(16)
    out = fp8_linear(x, qweight, scale)
    assert out is not None
    torch.testing.assert_close(out, quantized_linear_reference(x, qweight, scale), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (17, 688), (5, 7), (1536, 1024)])
def test_fp8_linear_matches_the_reference(rows: int, out_features: int, in_features: int) -> None:
    x, qweight, scale = fp8_operands(rows, out_features, in_features)
    out = fp8_linear(x, qweight, scale)
    expected = quantized_linear_reference(x, qweight, scale)
    assert out is not None and out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_fp8_bf16_in_and_out_equal_the_float32_path_rounded() -> None:
    x, qweight, scale = fp8_operands(5, 100, 136)
    x = x.bfloat16()
    out = fp8_linear(x, qweight, scale, torch.bfloat16)
    via_float = fp8_linear(x.float(), qweight, scale)
    assert out is not None and via_float is not None and torch.equal(out, via_float.to(torch.bfloat16))


def test_fp8_row_is_bitwise_the_same_in_any_batch() -> None:
    x, qweight, scale = fp8_operands(7, 72, 200)
    together = fp8_linear(x, qweight, scale)
    alone = torch.cat([fp8_linear(x[i:i + 1], qweight, scale) for i in range(7)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_matches_the_reference_across_tiles(monkeypatch: pytest.MonkeyPatch, weight_dtype: torch.dtype,
                                                         dtype: torch.dtype) -> None:
    monkeypatch.setattr(ql, "TILE_ELEMENTS", 7 * 96)  # 7 weight rows a tile: 100 rows = 15 tiles, the last short
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 96, generator=gen)
    if weight_dtype == torch.int8:
        qweight = torch.randint(-127, 128, (100, 96), generator=gen, dtype=torch.int8)
    else:
        qweight = fp8_operands(1, 100, 96)[1]
    scale = torch.rand(100, generator=gen) * 0.01 + 1e-4
    out = tiled_linear(x.to(dtype), qweight, scale, dtype)
    expected = quantized_linear_reference(x.to(dtype), qweight, scale)
    assert out is not None and out.dtype == dtype and out.shape == (40, 100)
    # The weights are widened exactly; a bf16 GEMM rounds its output (and oneDNN may sum in another order).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * float(expected.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_is_its_reference_bit_for_bit_and_row_independent(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(33, 203, generator=gen).to(dtype)
    x[3] *= 1000  # an outlier row must not coarsen the others: each row has its own activation scale
    x[5] = 0
    qweight = torch.randint(-127, 128, (37, 203), generator=gen, dtype=torch.int8)
    scale = torch.rand(37, generator=gen) * 0.01
    out = int8_gemm(x, qweight, scale, dtype)
    assert torch.equal(out, int8_gemm_reference(x, qweight, scale).to(dtype))
    assert torch.equal(out, torch.cat([int8_gemm(x[i:i + 1], qweight, scale, dtype) for i in range(33)]))
    assert torch.equal(out[5], torch.zeros(37, dtype=dtype))
    # W8A8: 8-bit activations on top of the weight-only map cost about a percent of the output's range.
    weight_only = quantized_linear_reference(x, qweight, scale)
    rows = [i for i in range(33) if i != 5]
    err = (out.float() - weight_only).abs().amax(dim=1)[rows] / weight_only.abs().amax(dim=1)[rows]
    assert float(err.max()) < 0.03


def test_mismatched_operands_are_refused() -> None:
    x, qweight, scale = fp8_operands(2, 8, 16)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_linear(x[:, :8], qweight, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn weight"):
        fp8_linear(x, qweight.float(), scale)
    with pytest.raises(ValueError, match="widen_weights"):
        widen_weights(qweight, torch.empty(3))
