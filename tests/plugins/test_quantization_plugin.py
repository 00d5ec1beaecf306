"""A third-party quantization technique (README.md's `ember-smooth`, installed for real) composed before the
built-in int8: the engine gives it calibration activations, it rescales each full-precision weight before int8
stores it, and the model computes exactly that (logits equal a reference built by hand from the formula)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember.errors import ManifestError, PluginError
from ember_platform import LLM
from ember_platform.engine.calibration import CalibrationContext, calibration_text, run_prefill
from ember_platform.engine.linear_method import linear_modules
from ember_platform.engine.models import build_model, load_weights
from ember_platform.engine.text.tokenizer import Tokenizer
from ember_plugins.attention.torch_paged import TorchPagedAttention
from ember_plugins.quantization.int8 import Int8LinearMethod, quantize_per_channel

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "weights"
IDS = list(range(100, 160))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(run_prefill(model, IDS))


def smoothed_int8_reference(alpha: float) -> torch.Tensor:
    """The model the formula describes, built by hand: each linear but lm_head gets the effective weight
    dequant(int8(W diag(s))) diag(1/s), with s from the inputs the full-precision model sees on the calibration
    text."""
    model = build_model(EXAMPLE, TorchPagedAttention, torch.float32)
    load_weights(model, EXAMPLE)
    text, _ = calibration_text(None)
    inputs = CalibrationContext(model, Tokenizer.from_dir(EXAMPLE), text, Path()).capture()
    for name, layer in linear_modules(model):
        if name == "lm_head":
            continue
        w = layer.weight.data
        x_max, w_max = inputs[name].abs().amax(dim=0).clamp(min=1e-5), w.abs().amax(dim=0).clamp(min=1e-5)
        s = x_max.pow(alpha) / w_max.pow(1 - alpha)
        q, scale = quantize_per_channel(w * s)
        w.copy_(q.float() * scale[:, None] / s)
    return logits(model)


@pytest.fixture
def smooth(use_plugins):
    use_plugins("smooth")
    from ember_smooth import technique

    technique.STATS.update(calibration_tokens=0, smoothed_layers=0)
    return technique.STATS


def test_smoothing_then_int8_computes_the_composed_formula(smooth: dict) -> None:
    # int8 weight-only at every batch size (its int8 GEMM above a few rows quantizes activations too): the formula.
    llm = LLM(EXAMPLE, quantization=["smooth", "int8"],
              quantization_options={"smooth": {"alpha": 0.5}, "int8": {"dense_threshold": -1}})
    assert llm.engine.selections["quantization"].name == "smooth+int8"
    model = llm.engine.model
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer.method.inner, Int8LinearMethod) and layer.weight.dtype == torch.int8
    assert smooth["smoothed_layers"] == 4 * 4  # every linear of the 4 layers; lm_head left to int8's skip
    # Calibration ran the default corpus (the example is not a package with a calibration.txt): 512 tokens.
    assert smooth["calibration_tokens"] == 512
    got = logits(model)
    expected = smoothed_int8_reference(0.5)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)
    plain_int8 = logits(LLM(EXAMPLE, quantization="int8", quantization_options={"dense_threshold": -1}).engine.model)
    assert (plain_int8 - expected).abs().max() > 20 * (got - expected).abs().max()  # not int8 alone


def test_smoothing_alone_keeps_the_full_precision_function(smooth: dict) -> None:
    full = logits(LLM(EXAMPLE).engine.model)
    smoothed = logits(LLM(EXAMPLE, quantization="smooth").engine.model)
    torch.testing.assert_close(smoothed, full, rtol=0, atol=1e-4)  # x/s @ (W s)^T = x W^T
    assert smooth["smoothed_layers"] == 16


def test_the_storing_method_must_come_last(smooth: dict) -> None:
    with pytest.raises(ValueError, match=r"int8 stores the weights of .*, so it must be the last quantization method"):
        LLM(EXAMPLE, quantization=["int8", "smooth"])


def test_options_are_a_table_per_method(smooth: dict) -> None:
    llm = LLM(EXAMPLE, quantization=["smooth", "int8"], quantization_options={"int8": {"kernel": "int8pack"}})
    assert llm.engine.model.model.layers[0].self_attn.qkv_proj.kernel == "int8pack"
    with pytest.raises(ValueError, match=r"options.smooth.beta: not supported by quantization 'smooth', which "
                                         r"reads only alpha"):
        LLM(EXAMPLE, quantization=["smooth", "int8"], quantization_options={"smooth": {"beta": 1}})
    with pytest.raises(PluginError, match=r"quantization.options.kernel: with several methods \(smooth, int8\), "
                                          r"\[quantization\] options are tables named after them"):
        LLM(EXAMPLE, quantization=["smooth", "int8"], quantization_options={"kernel": "native"})


def test_a_method_listed_twice_is_refused() -> None:
    with pytest.raises(ManifestError, match=r"quantization.method: a method is listed twice: \['int8', 'int8'\]"):
        LLM(EXAMPLE, quantization=["int8", "int8"])


def test_a_package_composes_in_its_manifest_and_calibrates_on_its_own_text(smooth: dict, tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "weights").symlink_to(EXAMPLE)
    (package / "ember.toml").write_text('[model]\nname = "smoothed"\nversion = "0.1.0"\n[runtime]\ndtype = "float32"\n'
                                        '[quantization]\nmethod = ["smooth", "int8"]\n'
                                        '[quantization.options.int8]\nkernel = "int8pack"\n'
                                        '[quantization.options.smooth]\nalpha = 0.25\n')
    text = "for key, value in sorted(items.items()):\n    print(key, value)\n" * 3
    (package / "calibration.txt").write_text(text)
    llm = LLM(package)
    assert llm.engine.selections["quantization"].options == {"int8": {"kernel": "int8pack"},
                                                             "smooth": {"alpha": 0.25}}
    assert llm.engine.model.model.layers[0].self_attn.qkv_proj.kernel == "int8pack"
    # The package's calibration text, not the default corpus, went through the model.
    assert smooth["calibration_tokens"] == len(llm.engine.tokenizer.encode(text, add_special_tokens=False))
