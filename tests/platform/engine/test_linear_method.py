"""Linear methods and the streaming loader: each layer's method is finalized as soon as its tensors are in (so
quantizing on load holds one full-precision layer), a tied LM head keeps the embedding, the families describe
their structure, and the calibration context captures what transformers' layers see."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ember_platform.engine.calibration import CalibrationContext, calibration_text, run_prefill  # noqa: E402
from ember_platform.engine.linear_method import (  # noqa: E402
    UNQUANTIZED,
    Linear,
    LinearSpec,
    UnquantizedLinearMethod,
    linear_modules,
    set_linear_methods,
)
from ember_platform.engine.models import build_model, load_weights  # noqa: E402
from ember_platform.engine.text.tokenizer import Tokenizer  # noqa: E402
from ember_plugins.attention.torch_paged import TorchPagedAttention  # noqa: E402
from ember_plugins.quantization.int8 import Int8Quantizer  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama" / "weights"
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=3, vocab_size=256, max_position_embeddings=256, initializer_range=0.1)


def save(config: transformers.PretrainedConfig, path: Path) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


class Recording(UnquantizedLinearMethod):
    """The full-precision method, recording how many other layers were partly loaded at each finalization."""

    def __init__(self, model_layers: list[Linear], log: list[int]) -> None:
        self.layers, self.log = model_layers, log

    def after_loading(self, layer: Linear) -> None:
        partly = [m for m in self.layers if m is not layer and not m.finalized
                  and any(not p.is_meta for p in m.parameters(recurse=False))]
        self.log.append(len(partly))


def test_each_layer_is_finalized_as_soon_as_its_tensors_are_in(tmp_path: Path) -> None:
    checkpoint = save(transformers.LlamaConfig(**TINY), tmp_path)
    model = build_model(checkpoint, TorchPagedAttention, torch.float32)
    layers, log = [m for _, m in linear_modules(model)], []
    method = Recording(layers, log)
    set_linear_methods(model, lambda spec: method, torch.float32)
    load_weights(model, checkpoint)
    assert len(log) == len(layers) == 3 * 4 + 1 and all(m.finalized for m in layers)
    # In file order a layer's q/k/v straddle its o_proj: at most one other layer is ever partly loaded.
    assert max(log) <= 1


def test_a_deferred_load_finalizes_nothing_until_asked(tmp_path: Path) -> None:
    checkpoint = save(transformers.LlamaConfig(**TINY), tmp_path)
    model = build_model(checkpoint, TorchPagedAttention, torch.float32)
    quantizer = Int8Quantizer({})
    set_linear_methods(model, lambda spec: quantizer.linear_method(spec, UNQUANTIZED), torch.float32)
    load_weights(model, checkpoint, finalize=False)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not qkv.finalized and qkv.weight.dtype == torch.float32  # still full precision: calibration runs here
    qkv.finish_loading()
    assert qkv.finalized and qkv.weight.dtype == torch.int8


def test_a_tied_lm_head_keeps_the_shared_embedding(tmp_path: Path) -> None:
    checkpoint = save(transformers.Qwen2Config(**TINY, tie_word_embeddings=True), tmp_path)
    model = build_model(checkpoint, TorchPagedAttention, torch.float32)
    quantizer = Int8Quantizer({"skip": []})  # would quantize lm_head too, were it not tied
    changed = set_linear_methods(model, lambda spec: quantizer.linear_method(spec, UNQUANTIZED), torch.float32)
    assert "lm_head" not in changed and model.lm_head.method is UNQUANTIZED
    load_weights(model, checkpoint)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's q/k/v biases stay the layer's own


def test_mixtral_quantizes_its_router_and_attention_on_load(tmp_path: Path) -> None:
    config = transformers.MixtralConfig(**{**TINY, "intermediate_size": 64}, num_local_experts=4,
                                        num_experts_per_tok=2)
    checkpoint = save(config, tmp_path)
    full = build_model(checkpoint, TorchPagedAttention, torch.float32)
    load_weights(full, checkpoint)
    model = build_model(checkpoint, TorchPagedAttention, torch.float32)
    quantizer = Int8Quantizer({})
    set_linear_methods(model, lambda spec: quantizer.linear_method(spec, UNQUANTIZED), torch.float32)
    load_weights(model, checkpoint)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.int8
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32  # stacked experts: not linears
    ids = list(range(10, 40))
    with torch.inference_mode():
        a, b = full.compute_logits(run_prefill(full, ids)), model.compute_logits(run_prefill(model, ids))
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_families_describe_their_structure(tmp_path: Path) -> None:
    model = build_model(transformers.MixtralConfig(**TINY, num_local_experts=4).to_dict()
                        | {"architectures": ["MixtralForCausalLM"]}, TorchPagedAttention)
    s = model.structure()
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    named = [s.embeddings, s.lm_head, *(f.norm for f in s.norm_feeds), *(n for f in s.norm_feeds for n in f.linears),
             *s.residual_writers, *(a.qkv for a in s.attention), *(a.output for a in s.attention)]
    assert all(n in modules or n in params for n in named)  # every name is a module or a stacked parameter
    assert s.norm_feeds[0].linears == ("model.layers.0.self_attn.qkv_proj",)
    assert s.norm_feeds[1].linears == ("model.layers.0.mlp.gate", "model.layers.0.mlp.experts.gate_up_proj")
    assert s.norm_feeds[-1].norm == "model.norm" and s.norm_feeds[-1].linears == ("lm_head",)
    assert len(s.attention) == 3 and s.attention[0].num_kv_heads == 2 and not s.tied_embeddings


def test_calibration_captures_the_inputs_transformers_layers_see() -> None:
    model = build_model(EXAMPLE, TorchPagedAttention, torch.float32)
    load_weights(model, EXAMPLE)
    text, source = calibration_text(None)
    calibration = CalibrationContext(model, Tokenizer.from_dir(EXAMPLE), text, source, max_tokens=200,
                                     sequence_length=64)
    sequences = calibration.token_sequences()
    assert [len(s) for s in sequences] == [64, 64, 64, 8]
    captured = calibration.capture(["model.layers.1.self_attn.qkv_proj", "model.layers.2.mlp.down_proj", "lm_head"])
    reference = transformers.AutoModelForCausalLM.from_pretrained(EXAMPLE, dtype=torch.float32)
    seen: dict[str, list[torch.Tensor]] = {"q": [], "down": [], "head": []}
    hooks = [reference.model.layers[1].self_attn.q_proj.register_forward_pre_hook(
                 lambda _m, a: seen["q"].append(a[0][0])),
             reference.model.layers[2].mlp.down_proj.register_forward_pre_hook(
                 lambda _m, a: seen["down"].append(a[0][0])),
             reference.lm_head.register_forward_pre_hook(lambda _m, a: seen["head"].append(a[0][0]))]
    with torch.inference_mode():
        for ids in sequences:
            reference(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    for ours, theirs in (("model.layers.1.self_attn.qkv_proj", "q"), ("model.layers.2.mlp.down_proj", "down"),
                         ("lm_head", "head")):
        torch.testing.assert_close(captured[ours], torch.cat(seen[theirs]), rtol=0, atol=1e-4)
    assert captured["lm_head"].shape == (200, 256)


def test_spec_names_the_checkpoint_modules_of_a_fused_layer() -> None:
    model = build_model(EXAMPLE, TorchPagedAttention)
    specs: dict[str, LinearSpec] = {}
    set_linear_methods(model, lambda spec: specs.setdefault(spec.prefix, spec) and UNQUANTIZED, torch.float32)
    qkv = specs["model.layers.0.self_attn.qkv_proj"]
    assert qkv.checkpoint_prefixes == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert qkv.shards == (("q", 256), ("k", 128), ("v", 128)) and qkv.kind == "qkv_proj"
    assert specs["lm_head"].checkpoint_prefixes == ("lm_head",)


def test_calibration_text_is_the_packages_own_when_it_has_one(tmp_path: Path) -> None:
    text, source = calibration_text(tmp_path)
    assert source.name == "calibration.txt" and source.parent.name == "data" and "def merge_intervals" in text
    (tmp_path / "calibration.txt").write_text("SELECT 1;\n" * 40)
    assert calibration_text(tmp_path) == ("SELECT 1;\n" * 40, tmp_path / "calibration.txt")
