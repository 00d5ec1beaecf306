"""`mixed`: the greedy plan spends the bit budget where it saves the most sensitivity, never above the budget, the
same every time; the engine stores each layer as the plan says (int4 and a higher precision side by side), and an
impossible budget is refused naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_platform import LLM
from ember_plugins.quantization.int4 import Int4Method
from ember_plugins.quantization.mixed import knapsack_plan, plan_layers

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "weights"
LADDER = ("int4_g128", "int8", "dense")
# The plan measured on 2048 calibration tokens, not the default 16384: what these tests check does not depend on
# the plan being the best one, and the default costs minutes per model.
FAST = {"calibration_tokens": 2048}


def layer(params: int, loss: dict[str, float]) -> dict[str, object]:
    return {"params": params, "bits": {"int4_g128": 4.3, "int8": 8.1, "dense": 32.0}, "loss": loss}


def test_the_budget_goes_to_the_layer_that_saves_most_per_bit_and_is_never_exceeded() -> None:
    layers = {"a": layer(100, {"int4_g128": 1.0, "int8": 0.1, "dense": 0.0}),
              "b": layer(100, {"int4_g128": 0.2, "int8": 0.05, "dense": 0.0}),
              "c": layer(100, {"int4_g128": 0.05, "int8": 0.0, "dense": 0.0})}
    assert plan_layers(layers, 4.3, LADDER) == {"a": "int4_g128", "b": "int4_g128", "c": "int4_g128"}
    plan = plan_layers(layers, 5.6, LADDER)  # room for one layer at int8: the most sensitive one gets it
    assert plan == {"a": "int8", "b": "int4_g128", "c": "int4_g128"}
    for budget in (4.5, 6.0, 8.0, 12.0, 20.0):
        plan = plan_layers(layers, budget, LADDER)
        spent = sum(layers[n]["params"] * layers[n]["bits"][p] for n, p in plan.items()) / 300
        assert spent <= budget + 1e-9
        assert plan == plan_layers(dict(reversed(list(layers.items()))), budget, LADDER)  # deterministic


def test_the_engine_stores_each_layer_as_planned() -> None:
    llm = LLM(EXAMPLE, quantization="mixed", quantization_options={"average_bits": 6.0, **FAST})
    linears = [m for name, m in llm.engine.model.named_modules() if hasattr(m, "mixed_method")]
    kinds = {type(m.mixed_method).__name__ for m in linears}
    assert linears and len(kinds) >= 2, kinds  # int4 for most, something more precise where it matters
    assert any(isinstance(m.mixed_method, Int4Method) for m in linears)
    out = llm.generate(["def main():\n    return"])[0]
    assert out.token_ids  # it runs end to end on the planned layers


def test_a_budget_below_int4_is_refused_naming_the_option() -> None:
    with pytest.raises(Exception, match=r"quantization\.options\.average_bits"):
        LLM(EXAMPLE, quantization="mixed", quantization_options={"average_bits": 2.0})
    with pytest.raises(Exception, match=r"quantization\.options\.calibration_tokens"):
        LLM(EXAMPLE, quantization="mixed", quantization_options={"calibration_tokens": 100})


def test_the_knapsack_plan_is_the_least_total_sensitivity_within_the_budget() -> None:
    """Where the greedy climb spends the budget on the best ratio first and is stuck, the knapsack finds the
    plan of least summed loss (checked against every plan there is)."""
    import itertools

    layers = {"a": layer(100, {"int4_g128": 1.0, "int8": 0.0, "dense": 0.0}),
              "b": layer(100, {"int4_g128": 0.6, "int8": 0.05, "dense": 0.0}),
              "c": layer(300, {"int4_g128": 3.0, "int8": 1.9, "dense": 0.0})}
    total = 500
    for budget in (4.3, 5.1, 6.0, 7.2, 9.0, 14.0, 20.0, 32.0):
        plan = knapsack_plan(layers, budget, LADDER)
        def spent(p: dict[str, str]) -> float:
            return sum(layers[n]["params"] * layers[n]["bits"][q] for n, q in p.items()) / total
        def loss(p: dict[str, str]) -> float:
            return sum(layers[n]["loss"][q] for n, q in p.items())
        assert spent(plan) <= budget + 1e-9
        feasible = [dict(zip(layers, combo, strict=True)) for combo in itertools.product(LADDER, repeat=3)]
        best = min(loss(p) for p in feasible if spent(p) <= budget + 1e-9)
        assert loss(plan) <= best + 1e-6, (budget, plan)
        assert loss(plan) <= loss(plan_layers(layers, budget, LADDER)) + 1e-12


def test_the_plan_is_the_candidate_with_the_lowest_calibration_loss(tmp_path: Path) -> None:
    """At exactly uniform int4 g64's bits, the uniform plan is a candidate: the plan kept has the lowest whole-model
    calibration cross-entropy (perplexity's measure, not the KL the candidates are also scored by)."""
    llm = LLM(EXAMPLE, quantization="mixed", quantization_options={"average_bits": 4.625, **FAST})
    technique = next(m.mixed_method for _, m in llm.engine.model.named_modules() if hasattr(m, "mixed_method"))
    assert technique is not None
    plan = _plan(llm)
    expected = {"greedy", "knapsack", "greedy by loss increase", "knapsack by loss increase", "uniform int4-g64",
                "uniform int4-g128"}
    assert set(plan["plan_loss_increase"]) == set(plan["plan_kl"]) == expected
    assert plan["plan_loss_increase"][plan["plan"]] == min(plan["plan_loss_increase"].values())
    assert plan["achieved_bits"] <= 4.625 + 1e-9
    assert plan["int4_activations"].startswith("int8 per group")  # measured as the native CPU kernel serves
    for layer in plan["layers"].values():  # both sensitivities kept, per rung (the loss increase may be negative)
        assert set(layer["loss_increase"]) == set(layer["sensitivity"]) == set(plan["ladder"])
        assert layer["loss_increase"]["dense"] == layer["sensitivity"]["dense"] == 0.0


def test_the_loss_increase_plan_is_the_least_summed_loss_increase() -> None:
    """Planned by loss increase, a layer whose rounding lowers the loss (a negative increase) is left at int4 and
    the bits go to the layer whose increase is largest, even where its KL is not."""
    layers = {"a": {**layer(100, {"int4_g128": 1.0, "int8": 0.0, "dense": 0.0}),
                    "kl": {"int4_g128": 1.0, "int8": 0.0, "dense": 0.0},
                    "loss_by": {"int4_g128": -0.2, "int8": 0.0, "dense": 0.0}},
              "b": {**layer(100, {"int4_g128": 0.5, "int8": 0.0, "dense": 0.0}),
                    "kl": {"int4_g128": 0.5, "int8": 0.0, "dense": 0.0},
                    "loss_by": {"int4_g128": 0.4, "int8": 0.0, "dense": 0.0}}}
    by_kl = {n: {**m, "loss": m["kl"]} for n, m in layers.items()}
    by_loss = {n: {**m, "loss": m["loss_by"]} for n, m in layers.items()}
    assert knapsack_plan(by_kl, 6.3, LADDER) == {"a": "int8", "b": "int4_g128"}
    assert knapsack_plan(by_loss, 6.3, LADDER) == {"a": "int4_g128", "b": "int8"}


def _plan(llm: LLM) -> dict:
    import json
    import os

    root = Path(os.environ["EMBER_QUANTIZED_CACHE"])
    options = dict(llm.engine.selections["quantization"].options)
    found = [json.loads(p.read_text()) for p in root.glob("*/quantization.json")]
    mine = [f["techniques"]["mixed"] for f in found if f.get("selection") == "mixed" and f["options"] == options]
    assert len(mine) == 1, found
    return mine[0]


def test_explain_prints_each_candidates_calibration_loss_and_each_layers_loss_increase(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from ember.cli import plugin_cmds

    llm = LLM(EXAMPLE, quantization="mixed", quantization_options={"average_bits": 4.625, **FAST})
    plan = _plan(llm)
    out = io.StringIO()
    monkeypatch.setattr(plugin_cmds, "console", Console(file=out, width=400))
    monkeypatch.setattr(plugin_cmds, "stored_quantization_state",
                        lambda *_: (Path("quantization.json"), {"techniques": {"mixed": plan}}))
    plugin_cmds.print_quantization_plans(Path(), "weights", None)
    text = out.getvalue()
    assert "calibration loss increase {" in text and "'knapsack by loss increase': " in text, text
    assert "loss increase" in text and f"the {plan['plan']} plan" in text, text


@pytest.mark.parametrize("group_size", [32, 128])
def test_the_calibration_computes_int4_layers_as_the_native_kernel_serves_them(group_size: int) -> None:
    """The plan is measured on what serves: with the hook mixed's calibration puts on an int4 layer, a float
    linear on the rounded weights computes what the native W4A8 kernel does (activations rounded to int8 per group;
    688 inputs: a last group cut short), not the weight-only product, which differs by far more."""
    import torch
    import torch.nn.functional as F

    from ember_kernels.cpu.int4_linear import int4_linear_available
    from ember_plugins.quantization.int4 import Int4Linear, prefill_rounds_activations, quantize_rtn
    from ember_plugins.quantization.mixed import round_activations_per_group

    if not int4_linear_available():
        pytest.skip("native CPU kernels unavailable")
    assert prefill_rounds_activations("auto", torch.device("cpu"), torch.float32)
    assert not prefill_rounds_activations("triton", torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(group_size)
    weight = torch.randn(96, 688, generator=gen) / 688 ** 0.5
    x = torch.randn(40, 688, generator=gen)
    x[:, 5] *= 30  # an outlier channel: its group's activations round coarsely
    weights = quantize_rtn(weight, group_size)
    served = Int4Linear(weights, None, kernel="native")(x)
    rounded = torch.nn.Linear(688, 96, bias=False)
    rounded.weight.data.copy_(weights.dequantize(torch.float32))
    rounded.register_forward_pre_hook(round_activations_per_group(group_size))
    with torch.inference_mode():
        imitated = rounded(x)
        weight_only = F.linear(x, weights.dequantize(torch.float32))
    err, weight_only_err = (float((y - served).abs().max()) for y in (imitated, weight_only))
    assert err < 1e-4 and weight_only_err > 100 * err, (err, weight_only_err)
