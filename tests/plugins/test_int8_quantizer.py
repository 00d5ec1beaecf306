"""The `int8` quantizer: each kernel computes the same linear map, a row's result never depends on the
rows batched with it, the dense path dequantizes once, and options are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ember_kernels.cpu.int8_linear import int8_linear, int8_linear_available
from ember_kernels.cpu.quantized_linear import int8_gemm_reference
from ember_platform import LLM, SamplingParams
from ember_platform.api import UNQUANTIZED, KernelOps, Linear, LinearSpec
from ember_plugins.quantization.int8 import (
    INT8PACK_DENSE_THRESHOLD,
    NATIVE_GEMM_THRESHOLD,
    Int8Linear,
    Int8LinearMethod,
    Int8Quantizer,
    fbgemm_available,
    quantize_per_channel,
    resolve_kernel,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
KERNELS = [
    "int8pack",
    pytest.param("fbgemm", marks=pytest.mark.skipif(not fbgemm_available(), reason="torch built without fbgemm")),
    pytest.param("native", marks=pytest.mark.skipif(not int8_linear_available(), reason="no native CPU kernels")),
]


def layer_weights(out_features: int = 48, in_features: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05, torch.randn(out_features, generator=gen)


def test_per_channel_quantization_round_trips_within_half_a_step() -> None:
    weight, _ = layer_weights()
    qweight, scale = quantize_per_channel(weight)
    assert qweight.dtype == torch.int8 and scale.shape == (weight.shape[0],)
    assert int(qweight.abs().max()) == 127  # each row's largest weight uses the whole range
    assert torch.all((qweight.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_computes_the_linear_map(kernel: str, dtype: torch.dtype) -> None:
    weight, bias = layer_weights()
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))  # [..., in] with two leading dims
    expected = x @ weight.T + bias
    y = Int8Linear(weight.to(dtype), bias.to(dtype), kernel)(x.to(dtype))
    assert y.shape == (2, 3, 48) and y.dtype == dtype
    # int8 weights (and, for fbgemm, 7-bit activations) on a unit-scale output: a few percent at most.
    assert float((y.float() - expected).abs().max()) < 0.03 * float(expected.abs().max())


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_does_not_depend_on_its_batch(kernel: str) -> None:
    weight, bias = layer_weights()
    module = Int8Linear(weight, bias, kernel)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    x[1] *= 1000  # an outlier row: with one activation scale for the whole batch it would coarsen the others
    x[2] = 0
    alone = torch.cat([module(x[i:i + 1]) for i in range(4)])
    assert torch.equal(module(x), alone)


def test_dense_path_dequantizes_once() -> None:
    weight, bias = layer_weights()
    module = Int8Linear(weight, bias, "int8pack", dense_threshold=4)
    x = torch.randn(8, 64)
    first = module(x)
    dense = module._dense
    assert dense is not None and torch.equal(dense, quantize_per_channel(weight)[0].float()
                                             * quantize_per_channel(weight)[1][:, None])
    assert torch.equal(module(x), first) and module._dense is dense  # kept, not made again
    module(x[:4])  # at or under the threshold: the int8 kernel, the dense weights untouched
    assert module._dense is dense


def quantized_layer(quantizer: Int8Quantizer, prefix: str = "model.layers.0.mlp.down_proj",
                    out_features: int = 32, in_features: int = 64) -> Linear:
    """A layer built and loaded as the engine does: the method the quantizer picks for it, its weight, then
    `after_loading` (through `finish_loading`)."""
    spec = LinearSpec(prefix, in_features, ((None, out_features),), False, torch.float32, (prefix,))
    layer = Linear(in_features, out_features, ops=KernelOps.reference(), method=quantizer.linear_method(spec,
                                                                                                      UNQUANTIZED))
    layer.weight = nn.Parameter(layer_weights(out_features, in_features)[0], requires_grad=False)
    layer.finish_loading()
    return layer


def test_quantizer_picks_int8_but_for_skipped_layers() -> None:
    quantizer = Int8Quantizer({"kernel": "int8pack"})
    proj, lm_head = quantized_layer(quantizer), quantized_layer(quantizer, "lm_head", 16, 32)
    assert isinstance(proj.method, Int8LinearMethod) and proj.weight.dtype == torch.int8
    assert lm_head.method is UNQUANTIZED and lm_head.weight.dtype == torch.float32
    assert proj.kernel == "int8pack" and proj.dense_threshold == INT8PACK_DENSE_THRESHOLD
    skip = Int8Quantizer({"skip": ["model.layers.0"]})  # a module prefix skips everything under it
    assert quantized_layer(skip).method is UNQUANTIZED
    assert isinstance(quantized_layer(skip, "model.layers.1.mlp.down_proj").method, Int8LinearMethod)


def test_int8_stores_weights_so_it_comes_last() -> None:
    spec = LinearSpec("model.layers.0.mlp.down_proj", 64, ((None, 32),), False, torch.float32, ())
    inner = Int8Quantizer({}).linear_method(spec, UNQUANTIZED)
    with pytest.raises(ValueError, match=r"int8 stores the weights of model\.layers\.0\.mlp\.down_proj, so it must be "
                                         r"the last quantization method"):
        Int8Quantizer({}).linear_method(spec, inner)


@pytest.mark.skipif(not int8_linear_available(), reason="no native CPU kernels")
def test_auto_picks_the_native_kernel_on_cpu_with_the_int8_gemm_above_a_few_rows() -> None:
    assert resolve_kernel("auto", torch.device("cpu")) == "native"
    layer = quantized_layer(Int8Quantizer({}))
    assert layer.kernel == "native" and layer.dense_threshold == NATIVE_GEMM_THRESHOLD
    x = torch.randn(NATIVE_GEMM_THRESHOLD + 3, 64, generator=torch.Generator().manual_seed(7))
    # Above the threshold: per-row int8 activations through the int8 GEMM, bit for bit; at or below: weight-only.
    assert torch.equal(layer(x), int8_gemm_reference(x, layer.weight, layer.weight_scale))
    few = x[:NATIVE_GEMM_THRESHOLD]
    assert torch.equal(layer(few), int8_linear(few, layer.weight, layer.weight_scale))
    assert not torch.equal(layer(x)[:NATIVE_GEMM_THRESHOLD], layer(few))  # two different computations


@pytest.mark.skipif(not int8_linear_available(), reason="no native CPU kernels")
def test_the_engine_runs_the_int8_gemm_for_prefill_and_the_native_kernel_for_decode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ember_plugins.quantization.int8 as int8_module

    calls = {"int8_gemm": 0, "int8_linear": 0}
    for name in calls:  # count the kernels' calls, each still running the real kernel
        real = getattr(int8_module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(int8_module, name, counted)
    llm = LLM(EXAMPLE, quantization="int8")
    prompt = list(range(100, 140))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    layers = len(llm.engine.model.model.layers) * 4
    assert calls == {"int8_gemm": layers, "int8_linear": layers * 4}


def test_auto_picks_int8pack_off_the_cpu() -> None:
    assert resolve_kernel("auto", torch.device("meta")) == "int8pack"


def test_dense_threshold_option() -> None:
    assert quantized_layer(Int8Quantizer({"kernel": "int8pack", "dense_threshold": -1})).dense_threshold is None
    assert quantized_layer(Int8Quantizer({"kernel": "int8pack", "dense_threshold": 8})).dense_threshold == 8


def test_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match=r"kernel 'int4' is not one of auto, native, fbgemm, int8pack"):
        Int8Quantizer({"kernel": "int4"})


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_with_speculation_and_batching_is_exact_for_greedy(kernel: str) -> None:
    # A request's tokens must not depend on the rows computed with it: drafts (k + 1 rows of one
    # request) or other requests in the batch.
    code = list(range(100, 140)) * 3
    others = [[5 + i, 77, 300 + i, 9] * 3 for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # The dense path off: prefill rows then go through the same kernel as decode rows.
    int8 = {"quantization": "int8", "quantization_options": {"kernel": kernel, "dense_threshold": -1}}
    alone = LLM(EXAMPLE, **int8).generate([code], params)[0].token_ids
    batched = LLM(EXAMPLE, **int8).generate([code, *others], params)[0].token_ids
    spec = LLM(EXAMPLE, **int8, speculator="ngram", num_speculative_tokens=4)
    assert batched == alone
    assert spec.generate([code], params)[0].token_ids == alone
    assert spec.engine.num_draft_tokens > 0


# Run in a child process: on a regression the kernel segfaults, which must fail this test, not end the whole run.
MISALIGNED_INT8PACK = """
import torch
from ember_plugins.quantization.int8 import Int8Linear, quantize_per_channel

gen = torch.Generator().manual_seed(0)
weight = torch.randn(512, 256, generator=gen) * 0.05
qweight, scale = quantize_per_channel(weight)
# As the quantized-weight cache hands them back: views into one buffer at odd offsets (safetensors mmap).
flat = torch.empty(qweight.numel() + 8, dtype=torch.int8)
view = flat[8:].view(512, 256)
view.copy_(qweight)
assert view.data_ptr() % 16, "the view must be misaligned for this test to mean anything"
module = Int8Linear(None, None, "int8pack", None, quantized=(view, scale))
ref = Int8Linear(None, None, "int8pack", None, quantized=(qweight, scale))
for rows in range(1, 40):
    buf = torch.randn(rows * 256 + 1, generator=gen).to(torch.bfloat16)
    x = buf[1:].view(rows, 256)  # an activation that starts 2 bytes past an aligned address
    assert torch.equal(module(x), ref(x.clone()))
print("ok")
"""


def test_int8pack_takes_misaligned_weights_and_activations() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", MISALIGNED_INT8PACK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_int8pack_from_the_quantized_weight_cache_generates_as_quantized(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's crash: the second start restores int8pack weights from the cache (mmapped, misaligned views).
    code = f"""
from ember_platform import LLM, SamplingParams
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
options = {{"quantization": "int8", "quantization_options": {{"kernel": "int8pack"}}}}
first = LLM({str(EXAMPLE)!r}, **options)
second = LLM({str(EXAMPLE)!r}, **options)
assert not first.engine.quantized_from_cache and second.engine.quantized_from_cache
prompt = ["import os, sys, re, json, time"]
assert first.generate(prompt, params)[0].token_ids == second.generate(prompt, params)[0].token_ids
print("ok")
"""
    import subprocess
    import sys

    env = {**__import__("os").environ, "EMBER_QUANTIZED_CACHE": str(tmp_path / "quantized")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-2000:])
