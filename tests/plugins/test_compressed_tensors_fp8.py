"""compressed-tensors fp8 checkpoints (`format: "float-quantized"`, written here with safetensors in the layout
llm-compressor writes for its FP8 / FP8_DYNAMIC schemes) load straight into the fp8 layers: a channel-wise checkpoint
matches Ember's own fp8 quantization token for token, a tensor-wise one computes what its dequantized weights
compute, and a W8A8 checkpoint is refused on a CPU unless asked to run weight-only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ember_platform import LLM, SamplingParams
from ember_platform.engine.calibration import run_prefill
from ember_plugins.quantization.fp8 import E4M3_MAX, Fp8LinearMethod, quantize_fp8_per_channel

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "weights"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser(", "import os\nimport sys\n\n\ndef main(",
           "class Config:\n    def __init__(self"]
DYNAMIC_TOKENS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


def quantization_config(strategy: str, input_activations: dict | None) -> dict:
    """What llm-compressor writes: FP8_DYNAMIC (channel weights, dynamic per-token activations), FP8 (tensor
    weights, static tensor activations), or fp8 weights alone."""
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": input_activations,
                                      "output_activations": None,
                                      "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                  "strategy": strategy, "group_size": None, "dynamic": False}}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
    }


def write_fp8_checkpoint(root: Path, strategy: str = "channel", input_activations: dict | None = None
                         ) -> tuple[Path, Path]:
    """(the float-quantized checkpoint, the same model with those fp8 weights dequantized) from the example."""
    quantized, dequantized = root / f"fp8-{strategy}", root / f"dequantized-{strategy}"
    out, deq = {}, {}
    for name, t in load_file(EXAMPLE / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if not name.endswith("_proj.weight"):
            out[name] = deq[name] = t
            continue
        if strategy == "channel":
            q, scale = quantize_fp8_per_channel(t)
            out[f"{module}.weight_scale"] = scale.to(t.dtype)[:, None]  # [out, 1], the model's dtype
        else:  # one scale for the tensor
            s = t.abs().max().float() / E4M3_MAX
            q = (t.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            scale = s.expand(t.shape[0])
            out[f"{module}.weight_scale"] = s.reshape(1).to(t.dtype)
            if input_activations is not None:
                out[f"{module}.input_scale"] = torch.tensor([0.05], dtype=t.dtype)  # FP8: static, per tensor
        out[name] = q
        deq[name] = (q.float() * scale.float()[:, None]).to(t.dtype)
    config = json.loads((EXAMPLE / "config.json").read_text())
    for path, state, extra in ((quantized, out, {"quantization_config": quantization_config(strategy,
                                                                                            input_activations)}),
                               (dequantized, deq, {})):
        path.mkdir(parents=True)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**config, **extra}))
        for name in TOKENIZER_FILES:
            if (EXAMPLE / name).is_file():
                shutil.copy(EXAMPLE / name, path / name)
    return quantized, dequantized


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    model = llm.engine.model
    with torch.inference_mode():
        return model.compute_logits(run_prefill(model, ids))


def test_a_channel_wise_checkpoint_matches_embers_fp8_token_for_token(tmp_path: Path) -> None:
    path, _ = write_fp8_checkpoint(tmp_path)
    loaded = LLM(path)
    layer = loaded.engine.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.method, Fp8LinearMethod) and layer.weight.dtype == torch.float8_e4m3fn
    assert not layer.method.full_precision_until_loaded  # stored fp8 tensors, never a full-precision copy
    assert loaded.engine.model.lm_head.weight.dtype == torch.float32  # ignored: full precision
    ember = LLM(EXAMPLE.parent, quantization="fp8")
    assert torch.equal(layer.weight.view(torch.uint8),
                       ember.engine.model.model.layers[0].mlp.gate_up_proj.weight.view(torch.uint8))
    got = [o.token_ids for o in loaded.generate(PROMPTS, GREEDY)]
    assert got == [o.token_ids for o in ember.generate(PROMPTS, GREEDY)]


def test_a_tensor_wise_checkpoint_computes_its_dequantized_weights(tmp_path: Path) -> None:
    # One scale per checkpoint tensor: q, k and v (and gate, up) each keep their own in the fused layer.
    path, dequantized = write_fp8_checkpoint(tmp_path, "tensor")
    llm = LLM(path)
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert len(set(qkv.weight_scale[:256].tolist())) == 1 and qkv.weight_scale[0] != qkv.weight_scale[300]
    ids = llm.engine.tokenizer.encode(PROMPTS[0])
    reference = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(llm, ids), expected, rtol=0, atol=2e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without an fp8 GPU")
@pytest.mark.parametrize(("strategy", "activations"), [
    ("channel", DYNAMIC_TOKENS),
    ("tensor", {**DYNAMIC_TOKENS, "strategy": "tensor", "dynamic": False}),
])
def test_a_w8a8_checkpoint_is_refused_on_cpu_unless_run_weight_only(tmp_path: Path, strategy: str,
                                                                     activations: dict) -> None:
    path, dequantized = write_fp8_checkpoint(tmp_path, strategy, activations)
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.input_activations: the checkpoint quantizes "
                                         r"activations to fp8.*compute capability >= 8\.9.*"
                                         r"quantization\.options\.activations = \"none\""):
        LLM(path)
    llm = LLM(path, quantization="compressed-tensors", quantization_options={"activations": "none"})
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.kernel != "scaled_mm" and "weight-only" in qkv.method.describe(qkv)
    ids = llm.engine.tokenizer.encode(PROMPTS[1])
    reference = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(llm, ids), expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize(("weights", "message"), [
    ({"strategy": "group", "group_size": 128}, r"weights\.strategy = 'group' for fp8"),
    ({"num_bits": 4}, r"weights\.num_bits = 4 \(supported: 8\)"),
    ({"dynamic": True}, r"weights with dynamic or group_size"),
])
def test_fp8_schemes_the_engine_cannot_load_are_refused(tmp_path: Path, weights: dict, message: str) -> None:
    path, _ = write_fp8_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"not supported yet: .*" + message):
        LLM(path)
