"""The `fp8` quantizer: e4m3 per-channel quantization, each path computing the same linear map, the engine running
the fp8 kernels (logits close to full precision yet not equal, held-out loss within 1%), the quantized-weight
cache, W8A8's math through torch._scaled_mm, and every refusal naming its option."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ember_plugins.quantization.fp8 as fp8_module
from ember_kernels.cpu.quantized_linear import (
    E4M3_MAX,
    amx_available,
    amx_gemm,
    bf16_gemm,
    bf16_gemm_available,
    fp8_linear,
    fp8_linear_available,
    tiled_linear,
)
from ember_platform import LLM, SamplingParams
from ember_platform.api import UNQUANTIZED, QuantizationError
from ember_platform.engine.calibration import run_prefill
from ember_plugins.quantization.fp8 import (
    TILED_THRESHOLD,
    Fp8Linear,
    Fp8LinearMethod,
    Fp8Quantizer,
    check_w8a8_device,
    quantize_fp8_per_channel,
    quantize_rows_fp8,
    scaled_mm_linear,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-llama"
native = pytest.mark.skipif(not fp8_linear_available(), reason="no native CPU kernels")
PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser("
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def layer_weights(out_features: int = 48, in_features: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05, torch.randn(out_features, generator=gen)


def test_per_channel_e4m3_keeps_each_weight_within_a_sixteenth() -> None:
    weight, _ = layer_weights()
    weight[3, 5] = 40.0  # one large weight: small weights of its row keep their relative precision
    qweight, scale = quantize_fp8_per_channel(weight)
    assert qweight.dtype == torch.float8_e4m3fn and scale.shape == (48,)
    assert torch.equal(qweight.float().abs().amax(dim=1), torch.full((48,), E4M3_MAX))  # each row uses the range
    back = qweight.float() * scale[:, None]
    normal = weight.abs() >= scale[:, None] * 2.0 ** -6  # e4m3 normals: 3 mantissa bits, half-ulp rounding
    assert torch.all(((back - weight).abs() <= weight.abs() / 16)[normal])
    assert torch.all(((back - weight).abs() <= scale[:, None] * 2.0 ** -10)[~normal])  # subnormal step / 2


@pytest.mark.parametrize("kernel", [pytest.param("native", marks=native), "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: above every dtype's tiled threshold
def test_each_path_computes_the_linear_map(kernel: str, dtype: torch.dtype, rows: int) -> None:
    weight, bias = layer_weights()
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    layer = Fp8Linear(weight.to(dtype), bias.to(dtype), kernel)
    qweight, scale = quantize_fp8_per_channel(weight.to(dtype))
    expected = x.to(dtype).float() @ (qweight.float() * scale[:, None]).T + bias.to(dtype).float()
    y = layer(x.to(dtype))
    assert y.shape == (rows, 48) and y.dtype == dtype and layer.weight.dtype == torch.float8_e4m3fn
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol * float(expected.abs().max()))


@native
def test_a_row_does_not_depend_on_its_batch_on_the_native_path() -> None:
    weight, bias = layer_weights()
    layer = Fp8Linear(weight, bias, "native", dense_threshold=-1)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    x[1] *= 1000
    assert torch.equal(layer(x), torch.cat([layer(x[i:i + 1]) for i in range(6)]))


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_choose_the_kernel_at_the_measured_threshold(dtype: torch.dtype) -> None:
    # At the threshold the streaming kernel, one row above it the GEMM path: amx_gemm for bf16 activations on an AMX
    # CPU, bf16_gemm on an AVX512_BF16 one, else the tiled GEMM; each equal to calling that kernel directly.
    weight, _ = layer_weights(100, 96)
    layer = Fp8Linear(weight.to(dtype), None)
    threshold = TILED_THRESHOLD[dtype]
    x = torch.randn(threshold + 1, 96, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert torch.equal(layer(x[:threshold]), fp8_linear(x[:threshold], layer.weight, layer.weight_scale, dtype))
    gemm = amx_gemm(x, layer.weight, layer.weight_scale, dtype)  # None unless bf16 on an AMX CPU
    if gemm is None:
        gemm = bf16_gemm(x, layer.weight, layer.weight_scale, dtype)
    if gemm is None:
        assert dtype == torch.float32 or not bf16_gemm_available()
        gemm = tiled_linear(x, layer.weight, layer.weight_scale, dtype)
    assert torch.equal(layer(x), gemm)
    if dtype == torch.bfloat16 and amx_available():  # and a row's result never depends on its batch there
        assert torch.equal(layer(x)[-1:], amx_gemm(x[-1:], layer.weight, layer.weight_scale, dtype))
    elif dtype == torch.bfloat16 and bf16_gemm_available():
        assert torch.equal(layer(x)[-1:], bf16_gemm(x[-1:], layer.weight, layer.weight_scale, dtype))


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    model = llm.engine.model
    with torch.inference_mode():
        return model.compute_logits(run_prefill(model, ids))


def held_out_loss(llm: LLM, text: str, window: int = 256, num_windows: int = 6) -> float:
    """Mean next-token cross-entropy over windows of `text`, one prefill each."""
    ids = llm.engine.tokenizer.encode(text)
    total, count = 0.0, 0
    for start in range(0, min(len(ids) - 1, window * num_windows), window):
        chunk = ids[start:start + window + 1]
        logits = prefill_logits(llm, chunk[:-1])
        total += float(F.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum"))
        count += len(chunk) - 1
    return total / count


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    return LLM(EXAMPLE), LLM(EXAMPLE, quantization="fp8")


@native
def test_the_engine_runs_the_fp8_kernels(engines: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    full, fp8 = engines
    qkv = fp8.engine.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Fp8LinearMethod) and qkv.weight.dtype == torch.float8_e4m3fn
    assert qkv.kernel == "native" and fp8.engine.model.lm_head.method is UNQUANTIZED  # skipped by default
    calls = {"fp8_linear": 0, "tiled_linear": 0}
    for name in calls:  # count the kernels' calls, each still running the real kernel
        real = getattr(fp8_module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fp8_module, name, counted)
    out = fp8.generate([PROMPT], GREEDY)[0].token_ids
    prompt_len = len(fp8.engine.tokenizer.encode(PROMPT))
    assert prompt_len > TILED_THRESHOLD[torch.float32]
    layers = len(fp8.engine.model.model.layers) * 4  # qkv, o, gate_up, down
    assert calls["tiled_linear"] == layers  # the prefill: one chunk above the threshold
    assert calls["fp8_linear"] == layers * (GREEDY.max_tokens - 1)  # every decode step
    # The text: close to full precision's (e4m3 weights move logits a little).
    reference = full.generate([PROMPT], GREEDY)[0].token_ids
    assert next((i for i, (a, b) in enumerate(zip(out, reference, strict=True)) if a != b), len(out)) >= 8


def test_logits_are_close_to_full_precision_but_not_equal(engines: tuple[LLM, LLM]) -> None:
    full, fp8 = engines
    ids = full.engine.tokenizer.encode(PROMPT * 2)
    a, b = prefill_logits(full, ids), prefill_logits(fp8, ids)
    diff = float((a - b).abs().max())
    assert 1e-3 < diff < 0.05 * float(a.abs().max()), diff  # measured: 0.19 of logits up to ~20


def test_held_out_perplexity_is_within_one_percent_of_full_precision(engines: tuple[LLM, LLM]) -> None:
    # Python the model never saw (it was trained on the standard library): this repository's own engine code.
    text = (ROOT / "platform" / "ember_platform" / "engine" / "scheduler.py").read_text()
    full, fp8 = engines
    base, quantized = held_out_loss(full, text), held_out_loss(fp8, text)
    assert quantized != base
    assert math.exp(quantized - base) - 1 < 0.01, (base, quantized)  # measured: +0.02% perplexity


def test_the_quantized_weight_cache_restores_fp8_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", str(tmp_path))
    first = LLM(EXAMPLE, quantization="fp8")
    second = LLM(EXAMPLE, quantization="fp8")
    assert not first.engine.quantized_from_cache and second.engine.quantized_from_cache
    layer = second.engine.model.model.layers[1].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and isinstance(layer.method, Fp8LinearMethod)
    assert second.generate([PROMPT], GREEDY)[0].token_ids == first.generate([PROMPT], GREEDY)[0].token_ids


def test_fp8_weights_compose_with_an_fp8_kv_cache() -> None:
    llm = LLM(EXAMPLE, quantization="fp8", kv_cache_dtype="fp8", kv_cache_memory_gb=0.01)
    assert llm.engine.executor.kv_caches[0][0].dtype == torch.float8_e4m3fn
    weights_only = LLM(EXAMPLE, quantization="fp8").generate([PROMPT], GREEDY)[0].token_ids
    out = llm.generate([PROMPT], GREEDY)[0].token_ids
    assert next((i for i, (a, b) in enumerate(zip(out, weights_only, strict=True)) if a != b), len(out)) >= 8


def test_w8a8_math_through_scaled_mm() -> None:
    # torch's CPU build runs _scaled_mm (slowly, emulated): enough to check the W8A8 formula the GPU path uses.
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(32, 64, generator=gen) * 0.05
    x = torch.randn(16, 64, generator=gen)
    x[2] *= 100  # per-token scales: an outlier row keeps the others' precision
    qweight, scale = quantize_fp8_per_channel(weight)
    y = scaled_mm_linear(x, qweight, scale, torch.float32)
    xq, x_scale = quantize_rows_fp8(x)
    expected = (xq.float() * x_scale) @ (qweight.float() * scale[:, None]).T
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    close = x @ weight.T
    assert float(((y - close).abs().amax(dim=1) / close.abs().amax(dim=1)).max()) < 0.1
    static = scaled_mm_linear(x[:1] * 0 + 1, qweight, scale, torch.float32, torch.tensor([0.5]))
    torch.testing.assert_close(static, (torch.full((1, 64), 2.0).to(torch.float8_e4m3fn).float() * 0.5)
                               @ (qweight.float() * scale[:, None]).T, rtol=1e-4, atol=1e-4)


def test_w8a8_is_refused_where_there_is_no_fp8_matmul() -> None:
    with pytest.raises(QuantizationError, match=r"quantization\.options\.activations = \"fp8\".*compute "
                                                r"capability >= 8\.9.*runs on cpu.*activations = \"none\""):
        check_w8a8_device(torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(QuantizationError, match=r"quantization\.options\.activations"):
            LLM(EXAMPLE, quantization="fp8", quantization_options={"activations": "fp8"})


@pytest.mark.parametrize(("options", "message"), [
    ({"kernel": "int4"}, r"quantization\.options\.kernel = 'int4': fp8 kernels are auto, native, torch"),
    ({"activations": "int8"}, r"quantization\.options\.activations = 'int8': fp8 takes none, fp8"),
    ({"dense_threshold": "many"}, r"quantization\.options\.dense_threshold = 'many': a whole number of rows"),
])
def test_bad_options_are_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(QuantizationError, match=message):
        Fp8Quantizer(options)


def test_unknown_options_are_refused_by_the_manifest_check() -> None:
    with pytest.raises(Exception, match=r"group_size"):
        LLM(EXAMPLE, quantization="fp8", quantization_options={"group_size": 64})


def test_fp8_stores_weights_so_it_comes_last() -> None:
    from ember_platform.api import LinearSpec

    spec = LinearSpec("model.layers.0.mlp.down_proj", 64, ((None, 32),), False, torch.float32, ())
    inner = Fp8Quantizer({}).linear_method(spec, UNQUANTIZED)
    with pytest.raises(QuantizationError, match=r"fp8 stores the weights of model\.layers\.0\.mlp\.down_proj"):
        Fp8Quantizer({}).linear_method(spec, inner)
