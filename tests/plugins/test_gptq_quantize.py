"""GPTQ's algorithm on one weight matrix: with inputs whose features are correlated and unevenly scaled (as real
activations are), its output error is lower than round-to-nearest's at the same bits and group size, act-order
reorders the columns and records their groups, dead inputs quantize to zero, and the 4-bit storage computes the
levels it was given."""

from __future__ import annotations

import pytest
import torch

from ember_platform.api import Linear
from ember_plugins.quantization.gptq import unpack_columns, unpack_rows
from ember_plugins.quantization.gptq_int4 import gptq_tensors, pack_columns, pack_rows
from ember_plugins.quantization.gptq_quantize import HessianAccumulator, gptq_quantize, rtn_quantize
from ember_plugins.quantization.int4_checkpoints import GPTQInt4Method


def correlated_inputs(num_rows: int = 2048, features: int = 256, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(features, features, generator=gen) / features**0.5
    scales = torch.exp(torch.randn(features, generator=gen))  # a few features much larger than the rest
    return (torch.randn(num_rows, features, generator=gen) @ mixing) * scales


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    for part in x.split(500):  # added in batches, as calibration does
        acc.add(part)
    return acc.hessian()


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((x @ (w - w_hat).T).norm() / (x @ w.T).norm())


def test_the_hessian_is_2_xtx_over_n() -> None:
    x = correlated_inputs(300, 32)
    torch.testing.assert_close(hessian_of(x), 2 * x.double().T @ x.double() / 300)


@pytest.mark.parametrize(("bits", "group_size", "sym"), [(4, 64, False), (4, 128, True), (4, -1, True), (8, -1, True)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_is_below_round_to_nearest(bits: int, group_size: int, sym: bool, act_order: bool) -> None:
    x = correlated_inputs()
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    # calibrated on one half of the rows, measured on the other: the gain is not overfitting to the samples
    q = gptq_quantize(w, hessian_of(x[:1024]), bits=bits, group_size=group_size, symmetric=sym, act_order=act_order,
                      damp=0.01)
    rtn = rtn_quantize(w, bits, group_size, sym)
    held_out = x[1024:]
    gptq_error, rtn_error = output_error(held_out, w, q.dequantize()), output_error(held_out, w, rtn.dequantize())
    assert gptq_error < 0.85 * rtn_error, (gptq_error, rtn_error)
    assert int(q.q.min()) >= (1 if sym and bits == 8 else 0) and int(q.q.max()) <= 2**bits - 1
    assert torch.all(q.zeros == 2 ** (bits - 1)) if sym else int(q.zeros.min()) >= 1


def test_act_order_quantizes_the_largest_inputs_first_and_records_their_groups() -> None:
    x = correlated_inputs()
    h = hessian_of(x)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    q = gptq_quantize(w, h, bits=4, group_size=64, symmetric=True, act_order=True, damp=0.01)
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    assert torch.equal(q.g_idx[order], torch.arange(256) // 64)  # groups are contiguous in processing order
    assert torch.bincount(q.g_idx).tolist() == [64] * 4
    plain = gptq_quantize(w, h, bits=4, group_size=64, symmetric=True, act_order=False, damp=0.01)
    assert torch.equal(plain.g_idx, torch.arange(256) // 64)
    # the error act-order saves is real: it beats the same groups in column order here
    assert output_error(x, w, q.dequantize()) < output_error(x, w, plain.dequantize())


def test_dead_inputs_quantize_to_zero_and_a_short_last_group_is_kept() -> None:
    x = correlated_inputs(1024, 200)
    x[:, 7] = 0.0
    w = torch.randn(32, 200, generator=torch.Generator().manual_seed(3))
    q = gptq_quantize(w, hessian_of(x), bits=4, group_size=64, symmetric=False, act_order=False, damp=0.01)
    assert q.num_groups == 4 and torch.bincount(q.g_idx).tolist() == [64, 64, 64, 8]
    assert torch.all(q.dequantize()[:, 7] == 0)


def test_an_indefinite_hessian_asks_for_more_damping() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="raise damp"):
        gptq_quantize(w, -torch.eye(16), bits=4, group_size=-1, symmetric=True, act_order=False, damp=0.01)


def test_packing_inverts_the_gptq_unpacking() -> None:
    values = torch.randint(0, 16, (32, 24))
    assert torch.equal(unpack_rows(pack_rows(values)).long(), values)
    assert torch.equal(unpack_columns(pack_columns(values)).long(), values)


@pytest.mark.parametrize(("group_size", "act_order", "sym"), [(64, False, True), (128, True, False), (-1, True, True)])
@pytest.mark.parametrize("kernel", ["dequant", "auto"])
def test_the_int4_layer_computes_the_levels_it_stores(group_size: int, act_order: bool, sym: bool,
                                                      kernel: str) -> None:
    x = correlated_inputs(1024, 256)
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(4))
    q = gptq_quantize(w, hessian_of(x), bits=4, group_size=group_size, symmetric=sym, act_order=act_order,
                      damp=0.01)
    layer = Linear(256, 48, ops=None, method=GPTQInt4Method(group_size, kernel))
    for name, tensor in gptq_tensors(q, torch.float32).items():  # as the loader gives a checkpoint's tensors
        param = torch.nn.Parameter(torch.empty_like(tensor), requires_grad=False)
        setattr(layer, name, param)
        layer.method.load_weight(layer, name, param, tensor, None)
    layer.finish_loading()
    expected = x[:5] @ q.dequantize().T
    if layer.kernel == "dequant":
        torch.testing.assert_close(layer(x[:5]), expected, rtol=1e-5, atol=1e-4)
    else:  # the native kernel quantizes the activations to 8 bits per group
        assert float((layer(x[:5]) - expected).abs().max()) < 0.02 * float(expected.abs().max())
