"""The `int4` quantizer: round-to-nearest stays within half a step of the weights, every kernel computes the
dequantized linear map (the native one exactly its integer reference), a row never depends on its batch, the
engine runs the int4 kernel on the example model within a bounded distance of full precision, and options
are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_kernels.cpu.int4_linear import int4_linear_available, int4_linear_reference, int4_pack
from ember_platform import LLM, SamplingParams
from ember_platform.engine.calibration import run_prefill
from ember_plugins.quantization import int4 as int4_module
from ember_plugins.quantization.int4 import (
    Int4Linear,
    Int4LinearMethod,
    Int4Quantizer,
    Int4Weights,
    pack_int4,
    quantize_rtn,
    unpack_int4,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
native = pytest.mark.skipif(not int4_linear_available(), reason="no native CPU kernels")


def weight(out_features: int = 48, in_features: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("group_size", "in_features"), [(32, 96), (64, 96), (128, 688)])  # 688: a short last group
def test_round_to_nearest_is_within_half_a_step(symmetric: bool, group_size: int, in_features: int) -> None:
    w = weight(40, in_features)
    q = quantize_rtn(w, group_size, symmetric)
    groups = -(-in_features // group_size)
    assert q.values.dtype == torch.uint8 and q.values.shape == w.shape and int(q.values.max()) <= 15
    assert q.scales.shape == (40, groups) and q.zeros.shape == (40, groups)
    assert torch.all(q.zeros == 8) == symmetric
    step = q.scales[:, q.group_index()]
    error = (q.dequantize() - w).abs()
    assert torch.all(error <= step / 2 * (1 + 1e-5))
    # The reference dequantization, written out: scale * (value - zero) of each weight's group.
    g = torch.arange(in_features) // group_size
    expected = (q.values.float() - q.zeros.float()[:, g]) * q.scales[:, g]
    assert torch.equal(q.dequantize(), expected)
    # Each group uses its range: symmetric reaches -8 (or 7) steps, asymmetric both ends, in every group.
    per_group = [q.values[:, g == i] for i in range(groups)]
    if symmetric:
        assert all(int(((v.long() - 8).abs()).amax()) >= 7 for v in per_group)
    else:
        assert all(int(v.amin()) == 0 and int(v.amax()) == 15 for v in per_group)


def test_asymmetric_is_closer_than_symmetric_on_a_shifted_weight() -> None:
    w = weight() + 0.04  # mostly positive: the symmetric grid wastes its negative half
    sym, asym = quantize_rtn(w, 32, True), quantize_rtn(w, 32, False)
    assert float((asym.dequantize() - w).pow(2).mean()) < 0.5 * float((sym.dequantize() - w).pow(2).mean())


def test_packing_round_trips_and_shapes_are_checked() -> None:
    values = torch.randint(0, 16, (5, 7), dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.shape == (5, 4) and torch.equal(unpack_int4(packed, 7), values)
    assert int(pack_int4(torch.tensor([[1, 2]]))[0, 0]) == 0x21  # the first value in the low nibble
    with pytest.raises(ValueError, match=r"need scales and zeros \(5, 1\)"):
        Int4Weights(values, torch.ones(5, 2), torch.zeros(5, 2, dtype=torch.uint8), 32)


@native
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), [(48, 64, 32), (40, 688, 16), (100, 200, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_computes_its_integer_reference(out_features: int, in_features: int, group_size: int,
                                                      dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    groups = -(-in_features // group_size)
    values = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=gen)
    scales = torch.rand(out_features, groups, generator=gen) * 0.01
    zeros = torch.randint(0, 16, (out_features, groups), generator=gen).float()
    packed = int4_pack(values, scales, zeros, group_size)
    assert packed is not None
    x = torch.randn(5, in_features, generator=gen).to(dtype)
    from ember_kernels.cpu.int4_linear import int4_linear

    y = int4_linear(x, *packed, out_features, group_size, dtype)
    assert y is not None and y.shape == (5, out_features) and y.dtype == dtype
    expected = int4_linear_reference(x, values, scales, zeros, group_size)
    # Exact integer group sums; only the float32 sum of the groups' scaled terms (and bf16's output rounding) differ.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((y.float() - expected).abs().max()) <= tolerance * float(expected.abs().max())


KERNELS = ["dequant", pytest.param("native", marks=native), "int4pack"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_kernel_computes_the_dequantized_linear_map(kernel: str) -> None:
    w, bias = weight(48, 128), torch.randn(48)
    q = quantize_rtn(w, 32, symmetric=False)
    layer = Int4Linear(q, bias, kernel)
    assert layer.kernel == kernel
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(1))
    expected = x @ q.dequantize().T + bias
    y = layer(x)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float32
    # dequant: float rounding only; native: int8 activations (half a step of 1/127 of each group's max);
    # int4pack: bf16 activations and scales.
    bound = {"dequant": 1e-5, "native": 0.02, "int4pack": 0.02}[kernel]
    assert float((y - expected).abs().max()) <= bound * float(expected.abs().max())
    # The weights the layer holds in its kernel's layout are the ones it was given.
    back = layer.method.weights(layer)
    assert torch.equal(back.values, q.values) and torch.equal(back.zeros, q.zeros)
    torch.testing.assert_close(back.scales, q.scales, rtol=1e-2 if kernel == "int4pack" else 0, atol=0)


@native
def test_a_row_does_not_depend_on_its_batch() -> None:
    layer = Int4Linear(quantize_rtn(weight(48, 128), 64), None, "native")
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(2))
    x[1] *= 1000  # an outlier row: its activation scales are its own, the other rows' are untouched
    x[2] = 0
    alone = torch.cat([layer(x[i:i + 1]) for i in range(40)])
    assert torch.equal(layer(x), alone)


def logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    model = llm.engine.model
    with torch.inference_mode():
        return model.compute_logits(run_prefill(model, ids))


@native
def test_the_engine_runs_int4_and_stays_near_full_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = int4_module.int4_linear

    def counting(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor | None:
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(int4_module, "int4_linear", counting)  # a spy: the real kernel still computes
    base = LLM(EXAMPLE)
    llm = LLM(EXAMPLE, quantization="int4", quantization_options={"group_size": 32})
    model = llm.engine.model
    layers = [m for m in model.modules() if isinstance(getattr(m, "method", None), Int4LinearMethod)]
    assert len(layers) == 4 * 4  # qkv, o, gate_up, down of 4 layers; lm_head skipped by default
    assert all(m.kernel == "native" and m.int4_packed.dtype == torch.uint8 for m in layers)
    assert all(not hasattr(m, "weight") for m in layers)  # the full-precision copy is gone
    assert model.lm_head.weight.dtype == torch.float32
    per_weight = sum(m.int4_packed.numel() for m in layers) / sum(m.in_features * m.out_features for m in layers)
    assert per_weight <= 0.51  # half a byte per weight (a little padding of the short last groups)
    ids = list(range(200, 260))
    reference, got = logits(base, ids), logits(llm, ids)
    assert calls and calls[-1] == len(ids) and len(calls) >= len(layers)  # every int4 layer ran the kernel
    difference = (got - reference).abs()
    # int4 moves logits (it is not the full-precision model), but boundedly: measured 0.25 mean, 3.2 max
    # against logits up to 13 at group 32.
    assert float(difference.mean()) > 1e-3
    assert float(difference.mean()) < 0.6 and float(difference.max()) < 0.5 * float(reference.abs().max())
    agree = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
    assert agree >= 0.8
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate(["def main("], params)[0].token_ids) == 8


@pytest.mark.parametrize(("options", "message"), [
    ({"group_size": 48}, r"quantization.options.group_size = 48: int4 takes one of 32, 64, 128"),
    ({"group_size": 128.0}, r"quantization.options.group_size = 128.0"),
    ({"symmetric": "yes"}, r"quantization.options.symmetric = 'yes': int4 takes one of True, False"),
    ({"kernel": "cuda"}, r"quantization.options.kernel = 'cuda'"),
    ({"skip": "lm_head"}, r"quantization.options.skip = 'lm_head': a list of layer names"),
])
def test_bad_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Int4Quantizer(options)
    with pytest.raises(ValueError, match=message):
        LLM(EXAMPLE, quantization="int4", quantization_options=options)


def test_an_option_int4_does_not_read_is_refused() -> None:
    with pytest.raises(Exception, match=r"quantization.options.bits: not supported by quantization 'int4'"):
        LLM(EXAMPLE, quantization="int4", quantization_options={"bits": 4})


def test_a_cpu_kernel_is_refused_off_the_cpu_and_triton_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    q = quantize_rtn(weight(), 32)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"quantization.options.kernel = 'triton' runs on CUDA GPUs"):
        Int4Linear(q, None, "triton")
    with pytest.raises(ValueError, match=r"quantization.options.kernel = 'native' runs on CPUs; this model is on meta"):
        int4_module.resolve_kernel("native", torch.device("meta"), q)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_across_the_kernels_blocks_of_rows_are_each_their_own(dtype: torch.dtype) -> None:
    # 1,100 rows of 1,024 inputs: the kernel's blocks of 512 rows (XQ_BLOCK_BYTES of quantized activations), the
    # last one partial; outputs a block and a tail of 16 (37); every row as alone (one row is one block: a row
    # read from the wrong block, or outputs stored at the wrong place, would differ).
    from ember_kernels.cpu.int4_linear import int4_linear

    gen = torch.Generator().manual_seed(5)
    values = torch.randint(0, 16, (37, 1024), dtype=torch.uint8, generator=gen)
    scales = torch.rand(37, 8, generator=gen) * 0.01
    zeros = torch.randint(0, 16, (37, 8), generator=gen).float()
    packed = int4_pack(values, scales, zeros, 128)
    x = torch.randn(1100, 1024, generator=gen).to(dtype)
    together = int4_linear(x, *packed, 37, 128, dtype)
    assert together is not None
    for row in (0, 511, 512, 513, 1023, 1024, 1099):
        assert torch.equal(int4_linear(x[row:row + 1], *packed, 37, 128, dtype), together[row:row + 1])
