"""Pre-quantized checkpoints: a compressed-tensors int8 checkpoint (written here with safetensors, in the layout
llm-compressor writes) loads straight into the int8 kernels, computes what the dequantized weights compute, never
makes a full-precision copy (peak RSS below the full-precision load), and what the format says that this engine
cannot do is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ember_platform import LLM, SamplingParams
from ember_platform.engine.calibration import run_prefill
from ember_plugins.quantization.compressed_tensors import unpack_int8
from ember_plugins.quantization.int8 import Int8LinearMethod, quantize_per_channel

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "weights"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def quantization_config(fmt: str = "int-quantized", ignore: tuple[str, ...] = ("lm_head",), **weights: object) -> dict:
    """What llm-compressor writes for a W8A16 channel-wise scheme."""
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                  "strategy": "channel", "group_size": None, "dynamic": False,
                                                  **weights}}},
        "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {},
    }


def pack_int32(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 for 8 bits: value + 128, four to an int32, the first in the low byte."""
    u = q.to(torch.int64) + 128
    u = torch.nn.functional.pad(u, (0, -u.shape[1] % 4))
    u = u.view(u.shape[0], -1, 4)
    packed = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16) | (u[..., 3] << 24)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def is_linear(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def write_checkpoints(source: Path, root: Path, fmt: str = "int-quantized",
                      ignore: tuple[str, ...] = ("lm_head",)) -> tuple[Path, Path]:
    """(the compressed-tensors checkpoint, the same model with its weights dequantized) made from `source`."""
    quantized, dequantized = root / "int8", root / "dequantized"
    tensors = load_file(source / "model.safetensors")
    out, deq = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not is_linear(name) or any(module == p or module.endswith("." + p) for p in ignore):
            out[name] = deq[name] = t
            continue
        q, scale = quantize_per_channel(t)
        scale = scale.to(t.dtype)
        if fmt == "int-quantized":
            out[name] = q
        else:
            out[f"{module}.weight_packed"] = pack_int32(q)
            out[f"{module}.weight_shape"] = torch.tensor(q.shape)
        out[f"{module}.weight_scale"] = scale[:, None]
        deq[name] = (q.float() * scale.float()[:, None]).to(t.dtype)
    config = json.loads((source / "config.json").read_text())
    for path, state, extra in ((quantized, out, {"quantization_config": quantization_config(fmt, ignore)}),
                               (dequantized, deq, {})):
        path.mkdir(parents=True)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**config, **extra}))
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, path / name)
    return quantized, dequantized


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_checkpoints(EXAMPLE, tmp_path_factory.mktemp("ct"))


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    model = llm.engine.model
    with torch.inference_mode():
        return model.compute_logits(run_prefill(model, ids))


PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser("
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_unpack_matches_the_documented_packing() -> None:
    # pack_to_int32's docstring: [1, 2] (8 bits) -> [129, 130, 0, 0] -> 0b00000000_00000000_10000010_10000001
    assert unpack_int8(torch.tensor([[0b10000010_10000001]], dtype=torch.int32), 2).tolist() == [[1, 2]]
    q = torch.randint(-127, 128, (5, 11), dtype=torch.int8)
    assert torch.equal(unpack_int8(pack_int32(q), 11), q)


def test_loads_into_the_int8_kernels_and_matches_the_dequantized_model(checkpoints: tuple[Path, Path]) -> None:
    quantized, dequantized = checkpoints
    llm = LLM(quantized)
    assert llm.engine.selections["quantization"].name == "none"  # nothing to choose: the checkpoint says it
    model = llm.engine.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Int8LinearMethod) and qkv.weight.dtype == torch.int8
    assert model.lm_head.weight.dtype == torch.float32  # ignored: stored in full precision
    # Weight-only at every batch size (the int8 GEMM, which quantizes a prefill's activations, off): what the
    # checkpoint's W8A16 scheme computes, against the independent reference, transformers on the dequantized weights.
    weight_only = LLM(quantized, quantization="compressed-tensors", quantization_options={"dense_threshold": -1})
    ids = llm.engine.tokenizer.encode(PROMPT)
    logits = prefill_logits(weight_only, ids)
    reference = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits, expected, rtol=0, atol=2e-3)
    # And the text: as the dequantized model's exactly (greedy); close to the original full-precision model's.
    tokens = weight_only.generate([PROMPT], GREEDY)[0].token_ids
    assert tokens == LLM(dequantized).generate([PROMPT], GREEDY)[0].token_ids
    original = LLM(EXAMPLE).generate([PROMPT], GREEDY)[0].token_ids
    agree = next((i for i, (a, b) in enumerate(zip(tokens, original, strict=True)) if a != b), len(tokens))
    assert agree >= 8, (agree, tokens, original)


def test_matches_the_same_model_quantized_by_ember_token_for_token(checkpoints: tuple[Path, Path]) -> None:
    # The acceptance check: the checkpoint as llm-compressor would write it, and `quantization = "int8"` on the
    # original weights, through the same kernels (defaults on both sides), give the same greedy text.
    prompts = [PROMPT, "import os\nimport sys\n\n\ndef main(", "class Config:\n    def __init__(self"]
    loaded = LLM(checkpoints[0]).generate(prompts, GREEDY)
    ember = LLM(EXAMPLE, quantization="int8").generate(prompts, GREEDY)
    assert [o.token_ids for o in loaded] == [o.token_ids for o in ember]


def test_pack_quantized_loads_the_same_weights(tmp_path: Path, checkpoints: tuple[Path, Path]) -> None:
    packed, _ = write_checkpoints(EXAMPLE, tmp_path, fmt="pack-quantized")
    ids = list(range(40, 80))
    a, b = LLM(checkpoints[0]), LLM(packed)
    assert torch.equal(prefill_logits(a, ids), prefill_logits(b, ids))
    assert not hasattr(b.engine.model.model.layers[0].mlp.gate_up_proj, "weight_packed")  # unpacked, then freed


def test_int8_on_a_prequantized_checkpoint_is_refused(checkpoints: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match=r"already quantized .*'compressed-tensors'.*method = \"none\""):
        LLM(checkpoints[0], quantization="int8")


@pytest.mark.parametrize(("change", "message"), [
    ({"format": "marlin-24"}, r"not supported yet: compressed-tensors format 'marlin-24'"),
    ({"format": "float-quantized"}, r"not supported yet: compressed-tensors int weights in format 'float-quantized'"),
    ({"config_groups.input_activations": {"num_bits": 8, "type": "int"}},
     r"not supported yet: .*input_activations \(activation quantization\)"),
    ({"weights.num_bits": 4}, r"not supported yet: compressed-tensors 4-bit weights in format 'int-quantized'"),
    ({"weights.num_bits": 2}, r"not supported yet: .*weights.num_bits = 2"),
    ({"weights.strategy": "group"}, r"not supported yet: .*weights.strategy = 'group'"),
    ({"kv_cache_scheme": {"num_bits": 8}}, r"not supported yet: compressed-tensors kv_cache_scheme"),
])
def test_what_the_engine_cannot_load_is_refused(tmp_path: Path, checkpoints: tuple[Path, Path],
                                                change: dict, message: str) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints[0], path)
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    group = qc["config_groups"]["group_0"]
    for key, value in change.items():
        if key.startswith("weights."):
            group["weights"][key.removeprefix("weights.")] = value
        elif key.startswith("config_groups."):
            group[key.removeprefix("config_groups.")] = value
        else:
            qc[key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(path)


def test_a_fused_layer_half_ignored_is_refused(tmp_path: Path) -> None:
    path, _ = write_checkpoints(EXAMPLE, tmp_path, ignore=("lm_head", "model.layers.0.self_attn.k_proj"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj: the checkpoint quantizes some"):
        LLM(path)


# --- peak memory ---------------------------------------------------------------------------------------------

PEAK_RSS = """
import sys
from ember_platform import LLM
llm = LLM(sys.argv[1], dtype="bfloat16", num_kv_blocks=4, **eval(sys.argv[2]))
assert llm.generate(["x"], __import__("ember_platform").SamplingParams(max_tokens=2))[0].token_ids
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(hwm * 1024)
"""


def peak_rss(checkpoint: Path, **overrides: object) -> int:
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, str(checkpoint), repr(overrides)], capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1",
                                                       "EMBER_QUANTIZED_CACHE": "off"})
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


@pytest.fixture(scope="module")
def larger(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """A random 90M-parameter Llama (bf16, 180 MB; 8 layers of hidden 1024) and its compressed-tensors int8 twin;
    and the bytes int8 saves (half of every linear's weights)."""
    root = tmp_path_factory.mktemp("larger")
    source = root / "bf16"
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(source)
    for name in TOKENIZER_FILES:
        shutil.copy(EXAMPLE / name, source / name)
    quantized, _ = write_checkpoints(source, root)
    linear_bytes = sum(t.numel() for n, t in load_file(source / "model.safetensors").items()
                       if is_linear(n) and n != "lm_head.weight")  # bf16 -> int8: one byte each saved
    return source, quantized, linear_bytes


def test_peak_memory_of_int8_loads_is_below_the_full_precision_load(larger: tuple[Path, Path, int]) -> None:
    source, quantized, saved = larger
    bf16 = peak_rss(source)
    prequantized = peak_rss(quantized)
    on_load = peak_rss(source, quantization="int8")
    print(f"\npeak RSS: bf16 {bf16 / 2**20:.0f} MiB, compressed-tensors int8 {prequantized / 2**20:.0f} MiB, "
          f"int8 quantized on load {on_load / 2**20:.0f} MiB; int8 linears save {saved / 2**20:.0f} MiB")
    # Loading the int8 checkpoint never holds a bf16 copy: it peaks lower by most of what int8 saves.
    assert prequantized < bf16 - 0.7 * saved
    # Quantizing on load holds one bf16 layer at a time (one layer is 1/8 of the linears here), not the model.
    assert on_load < bf16 - 0.6 * saved
