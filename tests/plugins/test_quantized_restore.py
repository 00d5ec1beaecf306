"""int4 and mixed layers, and a rotation whose seed was chosen among candidates, restored from the quantized-weight
cache: the second start loads what the first saved (int4 in a portable layout, mixed's plan, the rotation's
seed) and never quantizes or calibrates (the quantizers are made to fail if called), computing the same numbers
and the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ember_platform import LLM, SamplingParams
from ember_platform.engine.calibration import run_prefill
from ember_plugins.quantization import int4, int8, mixed, rotation
from ember_plugins.quantization.int4 import (
    Int4Linear,
    Int4Method,
    Int4StoredMethod,
    pack_int4,
    portable_int4,
    quantize_rtn,
)
from ember_plugins.quantization.int8 import Int8LinearMethod

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "weights"
IDS = list(range(300, 340))
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def logits(llm: LLM) -> torch.Tensor:
    with torch.inference_mode():
        return llm.engine.model.compute_logits(run_prefill(llm.engine.model, IDS))


def greedy(llm: LLM) -> list[int]:
    return llm.generate([IDS[:8]], PARAMS)[0].token_ids


def never(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("quantized or calibrated on a start that should restore")


def saved_file(cache: Path) -> dict[str, torch.Tensor]:
    (entry,) = cache.glob("*/model.safetensors")
    return load_file(entry)


@pytest.mark.parametrize("kernel", ["native", "int4pack", "dequant"])
def test_portable_layout_is_the_same_whatever_the_kernel(kernel: str) -> None:
    if kernel == "native" and not int4.int4_linear_available():
        pytest.skip("no native int4 library here")
    weights = quantize_rtn(torch.randn(64, 128), 64, symmetric=False)
    layer = Int4Linear(weights, kernel=kernel)
    saved = portable_int4(layer.method, layer)
    assert torch.equal(saved["int4_packed"], pack_int4(weights.values))
    torch.testing.assert_close(saved["int4_scales"], weights.scales, rtol=1e-2 if kernel == "int4pack" else 0,
                               atol=0)  # int4pack keeps its scales in bfloat16
    assert torch.equal(saved["int4_zeros"], weights.zeros)


def test_int4_layers_restore_from_the_cache_without_quantizing(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", str(tmp_path / "cache"))
    options = {"group_size": 64}
    first = LLM(EXAMPLE, quantization="int4", quantization_options=options)
    assert not first.engine.quantized_from_cache
    saved = saved_file(tmp_path / "cache")
    packed = saved["model.layers.0.mlp.down_proj.int4_packed"]
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (256, 688 // 2)  # portable: [out, in / 2]
    assert tuple(saved["model.layers.0.mlp.down_proj.int4_scales"].shape) == (256, 11)  # ceil(688 / 64) groups

    monkeypatch.setattr(int4, "quantize_rtn", never)
    monkeypatch.setattr(int4.Int4LinearMethod, "quantize", never)
    again = LLM(EXAMPLE, quantization="int4", quantization_options=options)
    assert again.engine.quantized_from_cache and again.engine.timings["quantize"] == 0.0
    down = again.engine.model.model.layers[0].mlp.down_proj
    assert isinstance(down.method, Int4StoredMethod) and down.group_size == 64
    assert down.kernel == first.engine.model.model.layers[0].mlp.down_proj.kernel
    torch.testing.assert_close(logits(again), logits(first), rtol=0, atol=0)
    assert greedy(again) == greedy(first)


def test_mixed_layers_restore_their_plan_from_the_cache_without_calibrating(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", str(tmp_path / "cache"))
    options = {"average_bits": 5.0, "group_size": 64, "calibration_tokens": 2048}
    first = LLM(EXAMPLE, quantization="mixed", quantization_options=options)
    assert not first.engine.quantized_from_cache
    plan = first.engine.quantization_states["mixed"]["layers"]
    assert {layer["precision"] for layer in plan.values()} - {"int4-g64"}  # something above int4 within 5 bits

    monkeypatch.setattr(mixed.MixedQuantizer, "calibrate", never)
    monkeypatch.setattr(int4, "quantize_rtn", never)
    monkeypatch.setattr(mixed, "quantize_per_channel", never)
    monkeypatch.setattr(int8, "quantize_per_channel", never)
    again = LLM(EXAMPLE, quantization="mixed", quantization_options=options)
    assert again.engine.quantized_from_cache and again.engine.timings["quantize"] == 0.0
    assert again.engine.quantization_states["mixed"]["layers"] == plan
    model = again.engine.model
    for name, layer in plan.items():
        method = model.get_submodule(name).method
        kind = {"int8": Int8LinearMethod, "dense": type(model.lm_head.method)}.get(layer["precision"], Int4Method)
        assert isinstance(method, kind), (name, layer["precision"], method)
    torch.testing.assert_close(logits(again), logits(first), rtol=0, atol=0)
    assert greedy(again) == greedy(first)


def test_rotation_candidates_and_int4_restore_the_chosen_seed(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", str(tmp_path / "cache"))
    options = {"rotation": {"seed": 3, "candidates": 2}, "int4": {"group_size": 64}}
    first = LLM(EXAMPLE, quantization=["rotation", "int4"], quantization_options=options)
    seed = first.engine.quantization_states["rotation"]["seed"]
    assert not first.engine.quantized_from_cache and seed in (3, 4)

    monkeypatch.setattr(rotation.RotationQuantizer, "calibrate", never)
    monkeypatch.setattr(rotation.RotationQuantizer, "_fold", never)
    monkeypatch.setattr(int4, "quantize_rtn", never)
    again = LLM(EXAMPLE, quantization=["rotation", "int4"], quantization_options=options)
    assert again.engine.quantized_from_cache and again.engine.timings["quantize"] == 0.0
    down = again.engine.model.model.layers[1].mlp.down_proj
    assert isinstance(down.method, rotation.OnlineRotationMethod) and down.method.rotation.seed == seed
    assert isinstance(down.method.inner, Int4StoredMethod)
    torch.testing.assert_close(logits(again), logits(first), rtol=0, atol=0)
    assert greedy(again) == greedy(first)
