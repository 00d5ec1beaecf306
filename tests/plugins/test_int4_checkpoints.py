"""4-bit checkpoints in the GPTQ and compressed-tensors pack-quantized layouts, written here (with safetensors, in
each tool's documented layout) from Ember's own int4 quantization of the example model, load straight into the
int4 layers and kernels and give the same model as quantizing on load: the same logits and greedy tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember_kernels.cpu.int4_linear import int4_linear_available
from ember_platform import LLM, SamplingParams
from ember_platform.engine.calibration import run_prefill
from ember_plugins.quantization.int4 import Int4Linear, Int4Weights, quantize_rtn
from ember_plugins.quantization.int4_checkpoints import CompressedTensorsInt4Method, GPTQInt4Method

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "weights"
EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
PROMPT = "import os\nimport sys\n\ndef main("
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
IDS = list(range(200, 260))
native = pytest.mark.skipif(not int4_linear_available(), reason="no native CPU kernels")


def pack_int32(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values (0..15) to an int32 along `dim` (0 or 1) of a 2-d tensor, the first in the lowest bits
    (AutoGPTQ's pack, and compressed-tensors' pack_to_int32 of values already offset by 8); zero-padded."""
    v = values.to(torch.int64) if dim == 1 else values.to(torch.int64).T
    v = torch.nn.functional.pad(v, (0, -v.shape[1] % 8)).view(v.shape[0], -1, 8)
    packed = sum(v[..., i] << (4 * i) for i in range(8))
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return (packed if dim == 1 else packed.T).contiguous()


def write(root: Path, state: dict[str, torch.Tensor], quantization_config: dict) -> Path:
    root.mkdir(parents=True)
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((EXAMPLE / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    for name in EXTRA_FILES:
        shutil.copy(EXAMPLE / name, root / name)
    return root


def quantized_linears(group_size: int, symmetric: bool):
    """(module name, Int4Weights) of each linear but lm_head, and the other tensors, from the example model."""
    linears, rest = {}, {}
    for name, t in load_file(EXAMPLE / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            linears[name.removesuffix(".weight")] = quantize_rtn(t, group_size, symmetric)
        else:
            rest[name] = t
    return linears, rest


def write_gptq(root: Path, group_size: int = 32, act_order: bool = False) -> tuple[Path, dict]:
    """GPTQ's layout (see gptq.py): qweight [in / 8, out], qzeros [groups, out / 8] minus one, scales [groups, out]
    in the model's dtype (float32 here), g_idx [in]. With `act_order` (what desc_act writes), each layer's inputs
    are taken in a shuffled order `perm` and grouped in that order: input perm[j] is in group j // group_size.
    Returns the checkpoint and, per module, (perm or None, the Int4Weights of the inputs in that order)."""
    linears, state = quantized_linears(group_size, symmetric=True)  # the "gptq" format cannot store zero 0
    gen = torch.Generator().manual_seed(7)
    made, perms = {}, {}
    for module, q in linears.items():
        in_features = q.values.shape[1]
        # Projections of the same input (q/k/v, gate/up) share one order: GPTQ's comes from the input's Hessian.
        parent, kind = module.rsplit(".", 1)
        source = f"{parent}.{kind}" if kind in ("o_proj", "down_proj") else parent  # the input it reads
        if act_order and source not in perms:
            perms[source] = torch.randperm(in_features, generator=gen)
        perm = perms.get(source)
        if perm is not None:
            q = quantize_rtn(q.dequantize()[:, perm], group_size)  # weights over the inputs in perm's order
        values, g_idx = q.values, torch.arange(in_features) // group_size
        if perm is not None:
            values, g_idx = torch.empty_like(values), torch.empty_like(g_idx)
            values[:, perm], g_idx[perm] = q.values, torch.arange(in_features) // group_size
        state[f"{module}.qweight"] = pack_int32(values.T, dim=0)
        state[f"{module}.qzeros"] = pack_int32(q.zeros.T.to(torch.int64) - 1, dim=1)
        state[f"{module}.scales"] = q.scales.T.contiguous()
        state[f"{module}.g_idx"] = g_idx.to(torch.int32)
        made[module] = (perm, q)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": True,
          "checkpoint_format": "gptq", "lm_head": False}
    return write(root, state, qc), made


def write_compressed_tensors(root: Path, group_size: int, symmetric: bool) -> Path:
    """compressed-tensors pack-quantized W4A16 (group strategy): weight_packed [out, in / 8] of signed values + 8,
    weight_scale [out, groups], weight_zero_point (asymmetric: packed down the outputs), weight_shape."""
    linears, state = quantized_linears(group_size, symmetric)
    for module, q in linears.items():
        # Ember's values are 0..15 with zero z; the signed values v - 8 with zero z - 8 are the same weights, and
        # the stored (offset) values are Ember's again.
        state[f"{module}.weight_packed"] = pack_int32(q.values, dim=1)
        state[f"{module}.weight_scale"] = q.scales
        state[f"{module}.weight_shape"] = torch.tensor(q.values.shape)
        if not symmetric:
            state[f"{module}.weight_zero_point"] = pack_int32(q.zeros, dim=0)
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group_size,
               "dynamic": False, "actorder": None, "observer": "minmax"}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                        "output_activations": None}},
          "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}
    return write(root, state, qc)


def logits(llm: LLM) -> torch.Tensor:
    model = llm.engine.model
    with torch.inference_mode():
        return model.compute_logits(run_prefill(model, IDS))


def int4_layers(llm: LLM, method: type) -> list:
    return [m for m in llm.engine.model.modules() if isinstance(getattr(m, "method", None), method)]


@native
def test_a_gptq_checkpoint_matches_embers_own_int4_token_for_token(tmp_path: Path) -> None:
    checkpoint = LLM(write_gptq(tmp_path / "gptq", group_size=32)[0])
    ember = LLM(EXAMPLE, quantization="int4", quantization_options={"group_size": 32})
    layers = int4_layers(checkpoint, GPTQInt4Method)
    assert len(layers) == 16 and all(m.kernel == "native" and not hasattr(m, "qweight") for m in layers)
    assert torch.equal(logits(checkpoint), logits(ember))  # the same integers, scales and kernel
    tokens = checkpoint.generate([PROMPT], GREEDY)[0].token_ids
    assert tokens == ember.generate([PROMPT], GREEDY)[0].token_ids


@native
@pytest.mark.parametrize(("group_size", "symmetric"), [(32, True), (64, False)])
def test_a_compressed_tensors_int4_checkpoint_matches_embers_own_int4(tmp_path: Path, group_size: int,
                                                                       symmetric: bool) -> None:
    checkpoint = LLM(write_compressed_tensors(tmp_path / "ct", group_size, symmetric))
    ember = LLM(EXAMPLE, quantization="int4",
                quantization_options={"group_size": group_size, "symmetric": symmetric})
    layers = int4_layers(checkpoint, CompressedTensorsInt4Method)
    assert len(layers) == 16 and all(m.kernel == "native" and not hasattr(m, "weight_packed") for m in layers)
    assert all(m.symmetric == symmetric for m in layers)
    assert torch.equal(logits(checkpoint), logits(ember))
    assert (checkpoint.generate([PROMPT], GREEDY)[0].token_ids == ember.generate([PROMPT], GREEDY)[0].token_ids)


@pytest.mark.parametrize("kernel", ["dequant", pytest.param("native", marks=native)])
def test_an_act_order_gptq_checkpoint_reads_its_inputs_in_group_order(tmp_path: Path, kernel: str) -> None:
    path, made = write_gptq(tmp_path / "act-order", act_order=True)
    llm = LLM(path, quantization="gptq", quantization_options={"kernel": kernel})
    name = "model.layers.0.mlp.down_proj"
    layer = llm.engine.model.get_submodule(name)
    perm, q = made[name]
    order = layer.int4_input_order
    assert layer.kernel == kernel and order.shape == perm.shape
    # The inputs are taken group by group (each group's in ascending order): the same groups as perm's.
    assert all(torch.equal(order[i:i + 32].sort().values, perm[i:i + 32].sort().values) for i in range(0, 688, 32))
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    # What GPTQ's act-order means: W[:, perm[j]] is the j-th column of the weights quantized in perm's order.
    expected = x[:, perm] @ q.dequantize().T
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=(1e-5 if kernel == "dequant" else 0.02)
                               * float(expected.abs().max()))
    if kernel == "native":  # exactly the int4 layer of perm's order: the same groups, exact integer group sums
        assert torch.equal(layer(x), Int4Linear(q, None, "native")(x[:, perm]))


def test_an_int4_checkpoint_refuses_what_it_cannot_load(tmp_path: Path) -> None:
    path = write_compressed_tensors(tmp_path / "ct", 32, True)
    with pytest.raises(ValueError, match=r"quantization.options.dense_threshold: a 4-bit compressed-tensors "
                                         r"checkpoint reads only kernel"):
        LLM(path, quantization="compressed-tensors", quantization_options={"dense_threshold": 8})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"not supported yet: .*weights.actorder = 'group' with num_bits 4"):
        LLM(path)


def test_the_int4_weights_of_a_checkpoint_are_the_stored_ones(tmp_path: Path) -> None:
    llm = LLM(write_gptq(tmp_path / "gptq")[0], quantization="gptq", quantization_options={"kernel": "dequant"})
    layer = llm.engine.model.model.layers[1].self_attn.o_proj
    got = layer.method.weights(layer)
    expected = quantize_rtn(load_file(EXAMPLE / "model.safetensors")["model.layers.1.self_attn.o_proj.weight"], 32)
    assert isinstance(got, Int4Weights)
    assert torch.equal(got.values, expected.values) and torch.equal(got.zeros, expected.zeros)
    assert torch.equal(got.scales, expected.scales)
