"""GPTQ 4-bit checkpoints (AutoGPTQ's layout, written here with safetensors from the example model) load as they
are stored and compute what their dequantized weights compute; what this engine cannot do yet is refused."""

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
from ember_plugins.quantization.gptq import GPTQLinearMethod, unpack_columns, unpack_rows
from ember_plugins.quantization.int4_checkpoints import GPTQInt4Method

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "weights"
GROUP = 16  # divides both 256 and 688, the example's input sizes


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[n, m] 0..15 -> [n / 8, m] int32, value k of each int32 from row 8 i + k (AutoGPTQ's pack)."""
    v = values.to(torch.int64).view(-1, 8, values.shape[1])
    packed = sum(v[:, k] << (4 * k) for k in range(8))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).contiguous()


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    packed = sum(v[..., k] << (4 * k) for k in range(8))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).contiguous()


def write_gptq(root: Path, **config_changes: object) -> tuple[Path, Path]:
    """(a GPTQ checkpoint of the example, 4-bit in groups of 16; its dequantized twin)."""
    quantized, dequantized = root / "gptq", root / "dequantized"
    out, deq = {}, {}
    for name, t in load_file(EXAMPLE / "model.safetensors").items():
        if not name.endswith("_proj.weight"):
            out[name] = deq[name] = t
            continue
        module = name.removesuffix(".weight")
        w = t.T.float()  # [in, out]
        groups = w.view(-1, GROUP, w.shape[1])  # [g, 16, out]
        # Symmetric, as GPTQ's default (sym=True): zero point 8. (The "gptq" format stores zero - 1, so an
        # asymmetric zero of 0 cannot be stored in it: the reason for "gptq_v2".)
        scales = (groups.abs().amax(dim=1) * 2 / 15).clamp(min=1e-8)  # [g, out]
        zeros = torch.full_like(scales, 8.0)
        q = torch.round(groups / scales[:, None] + zeros[:, None]).clamp(0, 15).view_as(w)  # [in, out]
        g_idx = torch.arange(w.shape[0]) // GROUP
        scales = scales.half()
        out[f"{module}.qweight"] = pack_rows(q)
        out[f"{module}.qzeros"] = pack_columns(zeros - 1)  # the "gptq" format stores zero points minus one
        out[f"{module}.scales"] = scales
        out[f"{module}.g_idx"] = g_idx.to(torch.int32)
        deq[name] = ((q - zeros[g_idx]) * scales.float()[g_idx]).T.contiguous()
    config = json.loads((EXAMPLE / "config.json").read_text())
    qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
          "checkpoint_format": "gptq", "lm_head": False, **config_changes}
    for path, state, extra in ((quantized, out, {"quantization_config": qc}), (dequantized, deq, {})):
        path.mkdir(parents=True)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**config, **extra}))
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(EXAMPLE / f, path / f)
    return quantized, dequantized


def test_unpacking_inverts_autogptq_packing() -> None:
    values = torch.randint(0, 16, (32, 24))
    assert torch.equal(unpack_rows(pack_rows(values)).long(), values)
    assert torch.equal(unpack_columns(pack_columns(values)).long(), values)
    assert unpack_rows(torch.tensor([[0x76543210]], dtype=torch.int32))[:, 0].tolist() == list(range(8))


@pytest.mark.parametrize("kernel", ["reference", "dequant"])
def test_a_gptq_checkpoint_computes_its_dequantized_weights(tmp_path: Path, kernel: str) -> None:
    quantized, dequantized = write_gptq(tmp_path)
    llm = LLM(quantized, quantization="gptq", quantization_options={"kernel": kernel})
    model = llm.engine.model
    down = model.model.layers[0].mlp.down_proj
    if kernel == "reference":  # kept as stored
        assert isinstance(down.method, GPTQLinearMethod) and down.qweight.dtype == torch.int32
        assert down.qweight.numel() * 4 == down.in_features * down.out_features // 2  # half a byte per weight
    else:  # in the int4 layers (test_int4_checkpoints.py: their native kernel)
        assert isinstance(down.method, GPTQInt4Method) and down.kernel == "dequant"
        assert down.int4_packed.numel() == down.in_features * down.out_features // 2
    ids = list(range(200, 260))
    with torch.inference_mode():
        got = model.compute_logits(run_prefill(model, ids))
        reference = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
        expected = reference(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = ["import os\nimport sys\n\ndef main("]
    assert llm.generate(prompt, params)[0].token_ids == LLM(dequantized).generate(prompt, params)[0].token_ids


@pytest.mark.parametrize(("change", "message"), [
    ({"bits": 8}, r"not supported yet: GPTQ quantization_config.bits = 8"),
    ({"checkpoint_format": "gptq_v2"}, r"not supported yet: GPTQ quantization_config.checkpoint_format = 'gptq_v2'"),
])
def test_what_is_not_supported_yet_is_refused(tmp_path: Path, change: dict, message: str) -> None:
    quantized, _ = write_gptq(tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        LLM(quantized)
