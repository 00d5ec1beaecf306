"""The AMX tile paths (amx_gemm.c): the W8A8 int8 GEMM on AMX-INT8 exact against integer arithmetic, `amx_gemm` for
int8 and e4m3 weights against the float32 reference (every e4m3
code, shapes with tails in rows, outputs and inputs), `amx_int4_linear` against int4's bf16 dequantization, bf16
out as the float32 result rounded, a row's result bit for bit the same in any batch, and the fp8, int8 and int4
layers handing bf16 batches above their thresholds to these kernels."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ember_kernels.cpu.quantized_linear as quantized_linear
import ember_plugins.quantization.fp8 as fp8_module
import ember_plugins.quantization.int4 as int4_module
import ember_plugins.quantization.int8 as int8_module
from ember_kernels.cpu.int4_linear import amx_int4_linear, int4_pack
from ember_kernels.cpu.quantized_linear import (
    amx_available,
    amx_gemm,
    amx_int8_available,
    int8_gemm,
    quantized_linear_reference,
)
from ember_plugins.quantization.fp8 import TILED_THRESHOLD, Fp8Linear
from ember_plugins.quantization.int4 import AMX_ROWS, Int4Linear, quantize_rtn
from ember_plugins.quantization.int8 import AMX_THRESHOLD, NATIVE_GEMM_THRESHOLD, Int8Linear

Operands = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # the `operands` fixture (conftest.py)
pytestmark = pytest.mark.skipif(not amx_available(), reason="no AMX here (CPU or OS)")
SHAPES = [(48, 64), (37, 203), (5, 1), (100, 1024), (70, 96)]



@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 70])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_matches_the_reference(kind: torch.dtype, rows: int, out_features: int, in_features: int,
                               operands: Operands) -> None:
    x, qweight, scale = operands(rows, out_features, in_features, kind)
    out = amx_gemm(x, qweight, scale, torch.float32)
    expected = quantized_linear_reference(x, qweight, scale)
    assert out is not None and out.shape == (rows, out_features) and out.dtype == torch.float32
    # Widened exactly, every product exact in float32: only the order of the sums differs.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_reads_every_e4m3_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)  # the NaN codes out
    qweight = codes.view(torch.float8_e4m3fn).reshape(16, 16).repeat(1, 3)[:, :45].contiguous()
    x = torch.randn(20, 45).bfloat16()
    out = amx_gemm(x, qweight, torch.ones(16), torch.float32)
    assert out is not None
    torch.testing.assert_close(out, quantized_linear_reference(x, qweight, torch.ones(16)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
def test_bf16_out_is_the_float32_result_rounded(kind: torch.dtype, operands: Operands) -> None:
    x, qweight, scale = operands(40, 37, 203, kind)
    x[2, 0] = float("nan")  # a NaN row stays NaN
    out, via_float = amx_gemm(x, qweight, scale, torch.bfloat16), amx_gemm(x, qweight, scale, torch.float32)
    assert out is not None and via_float is not None and out.dtype == torch.bfloat16
    finite = [i for i in range(40) if i != 2]
    assert torch.equal(out[finite].view(torch.int16), via_float[finite].to(torch.bfloat16).view(torch.int16))
    assert bool(torch.isnan(out[2]).all())


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
def test_a_row_is_bitwise_the_same_in_any_batch(kind: torch.dtype, operands: Operands) -> None:
    x, qweight, scale = operands(70, 29, 133, kind)
    x[1] *= 1000
    together = amx_gemm(x, qweight, scale, torch.float32)
    assert together is not None
    for rows in (1, 2, 16, 17, 33):
        assert torch.equal(amx_gemm(x[:rows], qweight, scale, torch.float32), together[:rows])
        assert torch.equal(amx_gemm(x[rows:rows + 1], qweight, scale, torch.float32), together[rows:rows + 1])


def test_float32_activations_are_left_to_the_other_paths(operands: Operands) -> None:
    x, qweight, scale = operands(8, 16, 32, torch.float8_e4m3fn)
    assert amx_gemm(x.float(), qweight, scale) is None  # rounding them to bf16 would change the map


@pytest.mark.parametrize(("rows", "out_features", "in_features", "group", "symmetric"),
                         [(1, 16, 64, 32, True), (5, 37, 200, 64, False), (70, 100, 1024, 128, True),
                          (33, 48, 96, 32, False)])
def test_int4_matches_its_bf16_dequantization(rows: int, out_features: int, in_features: int, group: int,
                                              symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    weights = quantize_rtn(torch.randn(out_features, in_features, generator=gen), group, symmetric)
    packed = int4_pack(weights.values, weights.scales, weights.zeros, group)
    assert packed is not None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    out = amx_int4_linear(x, *packed, out_features, group, torch.float32)
    # bf16(s q - s z) per weight (one rounding: int4's dense path's dequantize(bf16)), float32 sums
    expected = x.float() @ weights.dequantize(torch.bfloat16).float().T
    assert out is not None and out.shape == (rows, out_features)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    assert torch.equal(amx_int4_linear(x[-1:], *packed, out_features, group, torch.float32), out[-1:])
    assert amx_int4_linear(x.float(), *packed, out_features, group) is None


def counting(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_layers_hand_bf16_batches_above_their_thresholds_to_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 128, generator=gen) * 0.05
    cases = [(Fp8Linear(weight.bfloat16(), None), fp8_module, "amx_gemm", TILED_THRESHOLD[torch.bfloat16]),
             # where the int8 GEMM runs on AMX-INT8 (below), int8's batches go to it instead, from a few rows
             (Int8Linear(weight.bfloat16(), None), int8_module, "int8_gemm", NATIVE_GEMM_THRESHOLD)
             if amx_int8_available() else (Int8Linear(weight.bfloat16(), None), int8_module, "amx_gemm", AMX_THRESHOLD),
             (Int4Linear(quantize_rtn(weight, 64)), int4_module, "amx_int4_linear", AMX_ROWS)]
    for layer, module, name, threshold in cases:
        calls = counting(monkeypatch, module, name)
        x = torch.randn(threshold + 1, 128, generator=gen).bfloat16()
        with torch.inference_mode():
            y_small, y_large = layer(x[:threshold]), layer(x)
        assert calls == [threshold + 1], (name, calls)  # the batch above the threshold only
        assert y_small.shape == (threshold, 96) and y_large.dtype == torch.bfloat16
        # and the AMX result is the layer's map: close to the dequantized weights' product
        expected = x.float() @ (weight if module is int4_module else weight.bfloat16().float()).T
        torch.testing.assert_close(y_large.float(), expected, rtol=0.1, atol=0.1 * float(expected.abs().max()))


@pytest.mark.skipif(not amx_int8_available(), reason="no AMX-INT8 here")
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 70])
@pytest.mark.parametrize(("out_features", "in_features"), [*SHAPES, (130, 300)])
def test_int8_gemm_on_amx_int8_is_exact_integer_arithmetic(monkeypatch: pytest.MonkeyPatch, rows: int,
                                                            out_features: int, in_features: int) -> None:
    calls = []
    real = quantized_linear.native_function

    def spied(symbol: str, argtypes: list) -> object:
        fn = real(symbol, argtypes)
        if symbol != "ember_amx_int8_gemm" or fn is None:
            return fn

        def counted(*args: object) -> int:
            calls.append(args[6])  # M
            return fn(*args)

        return counted

    monkeypatch.setattr(quantized_linear, "native_function", spied)
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    qweight = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
    out = int8_gemm(x, qweight, scale, torch.float32)
    assert calls == [rows]  # the tile unit ran it
    # The same activation rounding as the reference, then integer sums (exact in float64 at these sizes) scaled
    # in the kernel's order: bit for bit.
    row_scale = x.float().abs().amax(dim=1, keepdim=True).div_(127.0).clamp_min_(torch.finfo(torch.float32).tiny)
    xq = torch.round(x.float() / row_scale)
    sums = (xq.double() @ qweight.double().T).float()
    assert torch.equal(out, sums.mul_(row_scale).mul_(scale))
    assert torch.equal(int8_gemm(x, qweight, scale, torch.bfloat16), out.bfloat16())
    if rows > 1:  # a row's result is the same in any batch
        assert torch.equal(int8_gemm(x[1:2], qweight, scale, torch.float32), out[1:2])
