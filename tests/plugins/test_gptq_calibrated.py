"""`gptq` on a full-precision package: the engine calibrates on the package's text, quantizes every linear but the LM
head layer after layer into int4 (or int8) layers, and serves with them: the logits are exactly those of the
dequantized GPTQ weights, which differ from both the dense and the round-to-nearest weights. The cold-start cache
restores them, and every option is checked."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import pytest
import torch

from ember.errors import PluginError
from ember_platform import LLM, SamplingParams
from ember_platform.api import UNQUANTIZED, CalibrationContext, Linear, LinearMethod, LinearSpec, QuantizationContext
from ember_platform.engine.calibration import run_prefill
from ember_platform.engine.linear_method import linear_modules, set_linear_methods
from ember_platform.engine.models import build_model
from ember_platform.engine.models.loader import load_weights
from ember_platform.engine.quantization import QuantizationError
from ember_platform.engine.text.tokenizer import Tokenizer
from ember_plugins.quantization.gptq import GPTQLinearMethod, GPTQQuantizer
from ember_plugins.quantization.gptq_calibrated import GPTQStoredMethod
from ember_plugins.quantization.gptq_quantize import rtn_quantize
from ember_plugins.quantization.int4 import Int4Method
from ember_plugins.quantization.int8 import Int8LinearMethod

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
SMALL = {"num_samples": 6, "seq_len": 128}  # 768 calibration tokens: quick, and plenty for a test
IDS = list(range(300, 364))


def gptq_package(root: Path, options: dict) -> Path:
    package = root / "pkg"
    package.mkdir()
    (package / "weights").symlink_to(EXAMPLE / "weights")
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    (package / "ember.toml").write_text('[model]\nname = "gptq-test"\nversion = "0.1.0"\n[runtime]\ndtype = "float32"\n'
                                        f'[quantization]\nmethod = "gptq"\noptions = {{ {table} }}\n')
    (package / "calibration.txt").write_text(inspect.getsource(json.decoder) + inspect.getsource(logging))
    return package


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(run_prefill(model, IDS))


def test_a_gptq_package_serves_with_int4_layers_that_compute_the_gptq_weights(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", str(tmp_path / "cache"))
    # The dequant kernel computes exactly with the stored weights (the native one also quantizes activations).
    package = gptq_package(tmp_path, {**SMALL, "group_size": 64, "kernel": "dequant"})
    llm = LLM(package)
    model = llm.engine.model
    assert llm.engine.timings["quantize"] > 0 and not llm.engine.quantized_from_cache
    quantized = {name: layer for name, layer in linear_modules(model) if isinstance(layer.method, GPTQStoredMethod)}
    assert len(quantized) == 16 and "lm_head" not in quantized  # 4 layers x (qkv, o, gate_up, down)
    down = quantized["model.layers.1.mlp.down_proj"]
    assert isinstance(down.method.storage, Int4Method) and down.kernel == "dequant"
    assert set(dict(down.named_parameters())) == {"qweight", "qzeros", "scales", "g_idx"}  # what it saves
    assert down.qweight.dtype == torch.int32 and down.int4_packed.dtype == torch.uint8  # half a byte per weight
    assert "gptq 4-bit sym, group 64, act-order: int4 symmetric, group 64, kernel=dequant" in down.extra_repr()
    assert not torch.equal(down.g_idx, torch.arange(688) // 64)  # act-order: groups follow the Hessian

    dense = LLM(package, quantization="none", quantization_options={})
    got, full = logits(model), logits(dense.engine.model)
    for name, layer in linear_modules(dense.engine.model):
        if name in quantized:
            stored = quantized[name]
            w = GPTQLinearMethod(64).dequantized(stored, torch.float32)  # the GPTQ layout it saves, unpacked
            rtn = rtn_quantize(layer.weight.data, 4, 64, True).dequantize()
            assert not torch.allclose(w, rtn, atol=1e-6), name  # error feedback moved weights off the nearest level
            layer.weight.data.copy_(w)
    torch.testing.assert_close(got, logits(dense.engine.model), rtol=0, atol=2e-4)
    assert float((got - full).abs().max()) > 1e-3  # and they are not the dense model's

    again = LLM(package)  # the next start restores the quantized weights from the cold-start cache
    assert again.engine.quantized_from_cache and again.engine.timings["quantize"] == 0.0
    torch.testing.assert_close(logits(again.engine.model), got, rtol=0, atol=1e-5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert again.generate([IDS[:8]], params)[0].token_ids == llm.generate([IDS[:8]], params)[0].token_ids


def test_8_bit_gptq_weights_go_into_the_int8_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", "off")
    llm = LLM(gptq_package(tmp_path, {**SMALL, "bits": 8, "group_size": -1, "act_order": False}))
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method.storage, Int8LinearMethod) and qkv.weight.dtype == torch.int8
    assert int(qkv.weight.abs().max()) <= 127 and qkv.weight_scale.shape == (512,)
    dense = LLM(EXAMPLE)
    got, full = logits(llm.engine.model), logits(dense.engine.model)
    assert 0 < float((got - full).abs().max()) < 0.05 * float(full.abs().max())  # 8 bits: close, not equal


@pytest.mark.parametrize(("options", "message"), [
    ({"bits": 3}, r"quantization.options.bits = 3: gptq stores 4-bit or 8-bit weights"),
    ({"group_size": 0}, r"quantization.options.group_size = 0"),
    ({"bits": 8}, r"quantization.options.group_size = 128: 8-bit gptq weights are stored in the int8 layers"),
    ({"bits": 8, "group_size": -1, "sym": False}, r"quantization.options.sym = false"),
    ({"damp": 0}, r"quantization.options.damp = 0"),
    ({"act_order": "yes"}, r"quantization.options.act_order = 'yes': expected true or false"),
    ({"num_samples": 0}, r"quantization.options.num_samples = 0"),
    ({"seq_len": 4096}, r"quantization.options.seq_len = 4096: longer than the model's max_position_embeddings"),
    ({"skip": "lm_head"}, r"quantization.options.skip = 'lm_head'"),
])
def test_options_are_checked(options: dict, message: str) -> None:
    # ValueError: a bad value is refused by ember's manifest check (OptionValueError, options.py) before the engine
    # builds gptq, which runs the same check; seq_len against the model's max_position_embeddings is the engine's.
    with pytest.raises(ValueError, match=message):
        LLM(EXAMPLE, quantization="gptq", quantization_options=options)


def test_an_unknown_option_is_refused_by_name() -> None:
    with pytest.raises(PluginError, match=r"quantization.options.frobnicate: not supported by quantization 'gptq'"):
        LLM(EXAMPLE, quantization="gptq", quantization_options={"frobnicate": 1})


def test_gptq_stores_the_weights_so_it_comes_last() -> None:
    with pytest.raises(QuantizationError, match=r"must be the last method"):
        LLM(EXAMPLE, quantization=["gptq", "int8"])


class Scaled(LinearMethod):
    """A method wrapping gptq's as an online rotation does (`inner`): its inputs reach the stored weight scaled
    per feature, which `calibration_input` says (or, without it, does not)."""

    def __init__(self, inner: LinearMethod, says: bool) -> None:
        self.inner, self.calls = inner, 0
        self.full_precision_until_loaded = True
        if says:
            self.calibration_input = self._calibration_input

    def _calibration_input(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * torch.linspace(0.1, 3.0, x.shape[-1])

    def create_weights(self, layer: Linear) -> None:
        self.inner.create_weights(layer)

    def after_loading(self, layer: Linear) -> None:
        self.inner.after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.inner.apply(layer, x * torch.linspace(0.1, 3.0, x.shape[-1]), bias)


def calibrated_down_proj(wrap: bool | None) -> tuple[torch.Tensor, Scaled | None]:
    """layer 0's down_proj levels after gptq calibrates the example, its method wrapped (says or not) or not."""
    from ember_plugins.attention.torch_paged import TorchPagedAttention

    hf_config = json.loads((EXAMPLE / "weights" / "config.json").read_text())
    model = build_model(hf_config, TorchPagedAttention, torch.float32)
    quantizer = GPTQQuantizer({**SMALL, "num_samples": 2, "kernel": "dequant"})
    quantizer.prepare(QuantizationContext(model.structure(), hf_config, None, ("scaled", "gptq"), 1))
    wrapped: list[Scaled] = []

    def factory(spec: LinearSpec) -> LinearMethod:
        method = quantizer.linear_method(spec, UNQUANTIZED)
        if wrap is not None and spec.prefix == "model.layers.0.mlp.down_proj":
            wrapped.append(Scaled(method, says=wrap))
            return wrapped[0]
        return method

    set_linear_methods(model, factory, torch.float32)
    load_weights(model, EXAMPLE / "weights", finalize=False)
    text = inspect.getsource(json.decoder)
    quantizer.calibrate(CalibrationContext(model, Tokenizer.from_dir(EXAMPLE / "weights"), text, EXAMPLE))
    layer = model.model.layers[0].mlp.down_proj
    return layer._gptq_result.q, (wrapped[0] if wrapped else None)


def test_a_wrapping_method_gives_gptq_the_inputs_its_weights_see() -> None:
    plain, _ = calibrated_down_proj(None)
    scaled, wrapper = calibrated_down_proj(True)
    assert wrapper is not None and wrapper.calls > 0  # the Hessian came from the wrapper's inputs ...
    assert not torch.equal(plain, scaled)  # ... which changes what GPTQ chooses
    with pytest.raises(QuantizationError, match=r"down_proj: Scaled wraps gptq's layers without saying"):
        calibrated_down_proj(False)
