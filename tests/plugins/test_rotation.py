"""`rotation` (QuaRot-style Hadamard rotations folded into the weights) on the example model, through the engine:
the rotated full-precision model computes the same logits, the engine holds and runs the rotated weights (norms
folded, embeddings rotated, an online Hadamard before down_proj), activation outliers are spread, it composes
before the storing methods (int8, int4, mixed) and is refused anywhere else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ember_platform import LLM, SamplingParams
from ember_platform.engine.calibration import CalibrationContext, calibration_text, run_prefill
from ember_platform.engine.text.tokenizer import Tokenizer
from ember_plugins.quantization import rotation
from ember_plugins.quantization.hadamard import RandomHadamard, hadamard
from ember_plugins.quantization.int4 import Int4Method
from ember_plugins.quantization.int8 import Int8LinearMethod
from ember_plugins.quantization.mixed import outlier_stats

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "weights"
IDS = list(range(100, 160))
ALL_SITES = {"sites": "all"}  # every rotation QuaRot folds (the default, "calibrated", may keep fewer)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(run_prefill(model, IDS))


@pytest.mark.parametrize("n", [1, 16, 64, 256, 688, 12])
def test_the_rotation_is_orthogonal_for_any_size_and_seeded(n: int) -> None:
    q = RandomHadamard(n, seed=3).matrix()
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    x = torch.randn(5, n, dtype=torch.float64)
    torch.testing.assert_close(RandomHadamard(n, seed=3).rotate(x), x @ q, rtol=0, atol=1e-12)  # same seed, same Q
    if n > 1:
        assert not torch.allclose(RandomHadamard(n, seed=4).matrix(), q)


def test_a_power_of_two_size_is_a_signed_hadamard_matrix() -> None:
    q = RandomHadamard(256, seed=0).matrix()
    # Every entry +-1/sqrt(n): an outlier channel is spread evenly over all of them.
    torch.testing.assert_close(q.abs(), torch.full((256, 256), 1 / 16, dtype=torch.float64), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(12)


def test_the_rotated_full_precision_model_computes_the_same_logits() -> None:
    full = LLM(EXAMPLE)
    expected = logits(full.engine.model)
    rotated = LLM(EXAMPLE, quantization="rotation", quantization_options=ALL_SITES)
    model = rotated.engine.model
    got = logits(model)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    # ... with other weights: the engine holds the rotated ones, not the checkpoint's.
    checkpoint = load_file(str(EXAMPLE / "model.safetensors"))
    embed = model.model.embed_tokens.weight
    assert (embed - checkpoint["model.embed_tokens.weight"]).abs().max() > 0.01
    # Rows keep their norms (an orthogonal map), columns do not keep their values.
    torch.testing.assert_close(embed.norm(dim=1), checkpoint["model.embed_tokens.weight"].norm(dim=1), rtol=1e-5,
                               atol=0)
    assert torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(256))  # folded into qkv_proj
    assert not torch.equal(checkpoint["model.layers.0.input_layernorm.weight"], torch.ones(256))
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down.method, rotation.OnlineRotationMethod)
    before = rotation.STATS["online_rotations"]
    logits(model)
    assert rotation.STATS["online_rotations"] - before == 4  # each down_proj rotated its input once
    assert rotation.STATS["folded_norms"] == 9 and rotation.STATS["rotated_linears"] == 17
    # Greedy text is the model's own.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert rotated.generate([IDS[:20]], params)[0].token_ids == full.generate([IDS[:20]], params)[0].token_ids


def test_the_online_rotation_is_needed() -> None:
    """Without rotating down_proj's input online, its weight would need the rotation of a nonlinear activation:
    `online = false` keeps down_proj's input basis, and the function is still exact."""
    expected = logits(LLM(EXAMPLE).engine.model)
    model = LLM(EXAMPLE, quantization="rotation", quantization_options={"online": False}).engine.model
    assert not isinstance(model.model.layers[0].mlp.down_proj.method, rotation.OnlineRotationMethod)
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-4)


def test_rotation_spreads_the_activation_outliers_the_quantizer_sees() -> None:
    text, _ = calibration_text(None)
    tokenizer = Tokenizer.from_dir(EXAMPLE)
    plain = CalibrationContext(LLM(EXAMPLE).engine.model, tokenizer, text, Path()).capture()
    rotated_model = LLM(EXAMPLE, quantization="rotation", quantization_options=ALL_SITES).engine.model
    rotated = CalibrationContext(rotated_model, tokenizer, text, Path()).capture()
    for i in range(4):
        for name in (f"model.layers.{i}.mlp.down_proj", f"model.layers.{i}.self_attn.qkv_proj"):
            before, _ = outlier_stats(plain[name])
            after, _ = outlier_stats(rotation_input(rotated_model, name, rotated[name]))
            # Measured: down_proj 4.6-6.1 -> 2.0-2.2, qkv_proj 2.1-4.3 -> 1.5-1.6.
            assert after < (0.5 if "down_proj" in name else 0.75) * before, (name, before, after)


def rotation_input(model: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """What the layer's method is given: a finalized down_proj rotates its input inside its forward."""
    layer = model.get_submodule(name)
    return layer.method.rotation.rotate(x) if isinstance(layer.method, rotation.OnlineRotationMethod) else x


def test_rotation_then_int8_stores_the_rotated_weights() -> None:
    expected = logits(LLM(EXAMPLE).engine.model)
    llm = LLM(EXAMPLE, quantization=["rotation", "int8"], quantization_options={"rotation": ALL_SITES})
    assert llm.engine.selections["quantization"].name == "rotation+int8"
    model = llm.engine.model
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down.method, rotation.OnlineRotationMethod) and isinstance(down.method.inner, Int8LinearMethod)
    assert down.weight.dtype == torch.int8
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.int8
    got = logits(model)
    assert (got - expected).abs().max() < 0.3  # int8's own error, on a rotated model
    # Restored from the quantized-weight cache (rotated norms and embeddings included), the same numbers.
    again = LLM(EXAMPLE, quantization=["rotation", "int8"], quantization_options={"rotation": ALL_SITES})
    assert again.engine.quantized_from_cache
    torch.testing.assert_close(logits(again.engine.model), got, rtol=0, atol=1e-5)


def test_rotation_then_int4() -> None:
    expected = logits(LLM(EXAMPLE).engine.model)
    model = LLM(EXAMPLE, quantization=["rotation", "int4"],
                quantization_options={"rotation": ALL_SITES, "int4": {"group_size": 32}}).engine.model
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down.method, rotation.OnlineRotationMethod) and isinstance(down.method.inner, Int4Method)
    assert (logits(model) - expected).abs().max() < 1.0


def test_rotation_must_come_first_and_before_a_storing_method(use_plugins) -> None:
    with pytest.raises(ValueError, match=r"'rotation' comes after 'int8'; a rotation rewrites the whole model's "
                                         r"full-precision weights, so it must come first \(e.g. \[\"rotation\", "):
        LLM(EXAMPLE, quantization=["int8", "rotation"])
    # A method that loads stored weights cannot be rotated either (the layer-level check, whatever the order).
    with pytest.raises(ValueError, match=r"rotation' rewrites full-precision weights, and lm_head loads stored ones"):
        rotation.RotationQuantizer({}).linear_method(_spec("lm_head"), Int8LinearMethod(prequantized=True))
    use_plugins("smooth")  # README's third-party transform: calibration after a rotation must see rotated weights
    with pytest.raises(ValueError, match=r"'rotation' comes after 'smooth'; a rotation rewrites the whole model's "
                                         r"full-precision weights, so it must come first"):
        LLM(EXAMPLE, quantization=["smooth", "rotation", "int8"])


def _spec(prefix: str):
    from ember_platform.engine.linear_method import LinearSpec

    return LinearSpec(prefix, 256, ((None, 4096),), False, torch.float32, (prefix,))


def test_options_are_checked_and_kv_rotation_is_refused() -> None:
    with pytest.raises(ValueError, match=r"quantization.options.kv_rotation = True: not supported yet"):
        LLM(EXAMPLE, quantization="rotation", quantization_options={"kv_rotation": True})
    with pytest.raises(ValueError, match=r"quantization.options.rotation.kv_rotation = True: not supported yet"):
        LLM(EXAMPLE, quantization=["rotation", "int8"], quantization_options={"rotation": {"kv_rotation": True}})
    with pytest.raises(ValueError, match=r"quantization.options.seed = -1: a non-negative integer"):
        LLM(EXAMPLE, quantization="rotation", quantization_options={"seed": -1})
    with pytest.raises(ValueError, match=r"quantization.options.online = 'yes': true or false"):
        LLM(EXAMPLE, quantization="rotation", quantization_options={"online": "yes"})
    with pytest.raises(ValueError, match=r"quantization.options.sites = 'some': \"calibrated\" \(each rotation kept "
                                         r"where .*, the default\) or \"all\" \(every rotation QuaRot folds\)"):
        LLM(EXAMPLE, quantization="rotation", quantization_options={"sites": "some"})
    with pytest.raises(ValueError, match=r"options.rotation.angle: not supported by quantization 'rotation'"):
        LLM(EXAMPLE, quantization=["rotation", "int8"], quantization_options={"rotation": {"angle": 1}})


def test_tied_embeddings_are_refused(tmp_path: Path) -> None:
    import json

    tied = tmp_path / "tied"
    tied.mkdir()
    config = json.loads((EXAMPLE / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tied / name).symlink_to(EXAMPLE / name)
    with pytest.raises(ValueError, match=r"'rotation': not supported yet for tied embeddings"):
        LLM(tied, quantization="rotation")


def test_rotation_then_gptq_calibrates_every_linear_down_proj_included() -> None:
    """gptq after a rotation: down_proj's stored weight is W R, so its Hessian must be of the rotated input x R
    (`OnlineRotationMethod.calibration_input`); a Hessian of x would fit the weights to the wrong inputs."""
    text, _ = calibration_text(None)
    ids = Tokenizer.from_dir(EXAMPLE).encode(text, add_special_tokens=False)[:256]
    options = {"rotation": ALL_SITES, "gptq": {"num_samples": 4, "seq_len": 128, "group_size": 64}}
    gptq = LLM(EXAMPLE, quantization=["rotation", "gptq"], quantization_options=options).engine.model
    rtn = LLM(EXAMPLE, quantization=["rotation", "int4"],
              quantization_options={"rotation": ALL_SITES, "int4": {"group_size": 64}}).engine.model
    # The same rotated weights, unquantized.
    dense = LLM(EXAMPLE, quantization="rotation", quantization_options=ALL_SITES).engine.model
    for i in range(4):
        down = gptq.model.layers[i].mlp.down_proj
        assert isinstance(down.method, rotation.OnlineRotationMethod), down.method
        assert down.method.describe(down).startswith("online Hadamard (43x16) + gptq 4-bit"), down.method.describe(down)
    # Each down_proj on the inputs it sees in the full-precision model: gptq's output error well below round to
    # nearest's (the Hessian of the right inputs), layer by layer.
    inputs: dict[int, torch.Tensor] = {}
    handles = [dense.model.layers[i].mlp.down_proj.register_forward_pre_hook(
        lambda _m, args, i=i: inputs.__setitem__(i, args[0].clone())) for i in range(4)]
    with torch.inference_mode():
        run_prefill(dense, ids)
    for handle in handles:
        handle.remove()
    with torch.inference_mode():
        for i, x in inputs.items():
            y = dense.model.layers[i].mlp.down_proj(x)

            def error(model: torch.nn.Module, x: torch.Tensor = x, y: torch.Tensor = y, i: int = i) -> float:
                return float((model.model.layers[i].mlp.down_proj(x) - y).norm() / y.norm())

            assert error(gptq) < 0.7 * error(rtn), (i, error(gptq), error(rtn))


def test_lora_adapters_are_refused_with_rotation(tmp_path: Path) -> None:
    """An adapter's A (of a residual reader) and B (of a writer) live in the unrotated basis: served on rotated
    weights they would add deltas in the wrong coordinates, so each one is refused, naming the setting."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(EXAMPLE)
    adapter = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    adapter.save_pretrained(tmp_path / "adapter")
    plain = LLM(EXAMPLE, quantization="int4")
    plain.engine.add_lora("a", tmp_path / "adapter")  # the same adapter on unrotated quantized weights: served
    assert plain.engine.lora is not None and "a" in plain.engine.lora.specs
    for method in ("rotation", ["rotation", "int4"]):
        rotated = LLM(EXAMPLE, quantization=method)
        with pytest.raises(ValueError, match=r"LoRA adapter 'a': not supported with \[quantization\] method "
                                             r"'rotation': not supported yet: the rotation rewrites the weights in "
                                             r"a rotated basis"):
            rotated.engine.add_lora("a", tmp_path / "adapter")


def test_candidates_choose_the_seed_whose_int4_model_is_closest_on_calibration_text() -> None:
    options = {"rotation": {"seed": 5, "candidates": 3, **ALL_SITES}, "int4": {"group_size": 64}}
    llm = LLM(EXAMPLE, quantization=["rotation", "int4"], quantization_options=options)
    state = _saved_rotation_state(llm)
    kl = {int(seed): value for seed, value in state["search_kl"].items()}
    assert sorted(kl) == [5, 6, 7] and all(value > 0 for value in kl.values())
    best = min(kl, key=lambda s: (kl[s], s))
    assert state["seed"] == best
    # The searched model is exactly the chosen seed's: nothing left over from the candidates tried before it.
    chosen = LLM(EXAMPLE, quantization=["rotation", "int4"],
                 quantization_options={"rotation": {"seed": best, **ALL_SITES}, "int4": {"group_size": 64}})
    torch.testing.assert_close(logits(llm.engine.model), logits(chosen.engine.model), rtol=0, atol=1e-5)
    # Restored from the quantized-weight cache: the saved seed's online rotation, the same numbers.
    options = {"rotation": {"seed": 5, "candidates": 3}}
    first = LLM(EXAMPLE, quantization=["rotation", "int8"], quantization_options=options)
    assert not first.engine.quantized_from_cache
    again = LLM(EXAMPLE, quantization=["rotation", "int8"], quantization_options=options)
    assert again.engine.quantized_from_cache
    torch.testing.assert_close(logits(again.engine.model), logits(first.engine.model), rtol=0, atol=1e-5)


def _saved_rotation_state(llm: LLM) -> dict:
    """The rotation's state() as the engine saved it beside the quantized-weight cache (quantization.json)."""
    import json
    import os

    root = Path(os.environ["EMBER_QUANTIZED_CACHE"])
    states = [json.loads(p.read_text()) for p in root.glob("*/quantization.json")]
    mine = [s for s in states if s.get("selection") == llm.engine.selections["quantization"].name
            and s["options"] == dict(llm.engine.selections["quantization"].options)]
    assert len(mine) == 1, states
    return mine[0]["techniques"]["rotation"]


def test_explain_prints_the_seed_the_rotation_chose(tmp_path: Path) -> None:
    import os
    import shutil
    import subprocess
    import sys

    package = tmp_path / "tiny-llama"
    shutil.copytree(EXAMPLE.parent, package, copy_function=os.link, ignore=shutil.ignore_patterns("speculator"))
    toml = (package / "ember.toml").read_text()
    (package / "ember.toml").unlink()  # a hardlink to the example's own file: writing through it would edit that
    (package / "ember.toml").write_text(toml + '\n[quantization]\nmethod = ["rotation", "int8"]\n'
                                        'options = { rotation = { seed = 2, candidates = 2 } }\n')
    LLM(package)  # quantizes, choosing the seed, and saves the choice beside the cached weights
    out = subprocess.run([sys.executable, "-m", "ember", "explain", str(package)], capture_output=True, text=True,
                         env=os.environ, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "quantization 'rotation'" in out.stdout and '"candidates": 2' in out.stdout, out.stdout
    assert '"search_kl": {"2": ' in out.stdout and '"3": ' in out.stdout, out.stdout


def test_calibrated_sites_keep_each_rotation_only_where_it_quantizes_better(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """sites = "calibrated": the residual rotation by the calibration KL of the int4-rounded model, each online and
    value-head rotation by its layers' reconstruction error; the model computes what it did (any subset of the
    rotations is exact), the engine applies what was kept, and a restart restores the choice from the cache."""
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", str(tmp_path / "cache"))
    dense = LLM(EXAMPLE)
    expected = logits(dense.engine.model)
    norm = dense.engine.model.model.layers[0].input_layernorm.weight.detach().clone()
    only = LLM(EXAMPLE, quantization="rotation", quantization_options={"sites": "calibrated"})
    torch.testing.assert_close(logits(only.engine.model), expected, rtol=0, atol=1e-4)

    options = {"rotation": {"sites": "calibrated", "search_group_size": 64}, "int4": {"group_size": 64}}
    llm = LLM(EXAMPLE, quantization=["rotation", "int4"], quantization_options=options)
    state = llm.engine.quantization_states["rotation"]
    kl = state["search_kl"]
    assert set(kl) == {"0", "0 no residual"} and state["residual"] == (kl["0"] <= kl["0 no residual"])
    model = llm.engine.model
    folded = bool(torch.all(model.model.layers[0].input_layernorm.weight == 1))
    assert folded == state["residual"] and (folded or torch.equal(model.model.layers[0].input_layernorm.weight, norm))
    for i in range(4):
        down = model.model.layers[i].mlp.down_proj
        name = f"model.layers.{i}.mlp.down_proj"
        errors = state["site_errors"][name]
        kept = errors["rotated"] < errors["unrotated"]
        assert (name in state["online_layers"]) == kept == (down.method.rotation is not None)
    assert (logits(model) - expected).abs().max() < 2.0  # int4 g64's own error (max over 60 x 4096 logits)

    again = LLM(EXAMPLE, quantization=["rotation", "int4"], quantization_options=options)
    assert again.engine.quantized_from_cache and again.engine.quantization_states["rotation"] == state
    torch.testing.assert_close(logits(again.engine.model), logits(model), rtol=0, atol=0)


def test_the_default_sites_are_calibrated_and_all_stays_available() -> None:
    """With no options the rotations are chosen on calibration text (`sites = "calibrated"`: what beats plain
    round-to-nearest int4 on the example model), and `sites = "all"` still folds every one, as QuaRot."""
    from ember_plugins.quantization.options import check_rotation

    assert check_rotation({})["sites"] == "calibrated" and check_rotation(ALL_SITES)["sites"] == "all"
    default = LLM(EXAMPLE, quantization=["rotation", "int4"])
    state = default.engine.quantization_states["rotation"]
    assert state["sites"] == "calibrated" and set(state["search_kl"]) == {"0", "0 no residual"}, state
    kl = state["search_kl"]
    assert state["site_errors"] and state["residual"] == (kl["0"] <= kl["0 no residual"])
    every = LLM(EXAMPLE, quantization=["rotation", "int4"], quantization_options={"rotation": ALL_SITES})
    state = every.engine.quantization_states["rotation"]
    assert state["sites"] == "all" and state["residual"] and not state["site_errors"], state
    model = every.engine.model
    assert torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(256))  # the norms folded
    assert all(model.model.layers[i].mlp.down_proj.method.rotation is not None for i in range(4))
