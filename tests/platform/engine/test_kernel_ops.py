"""The kernel-op table: plugins' impls in priority order, declines falling through to torch, and an engine using a
third-party kernel op end to end (README's "ember-silu-count", installed for real)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ember import hookimpl
from ember.errors import PluginError
from ember.plugins import PluginHost
from ember_platform import LLM, SamplingParams
from ember_platform.engine.kernel_ops import REFERENCES, KernelOps

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"


class SiluPlugin:
    """An in-code plugin: silu_and_mul that counts its calls, declining gate_up with more than `max_rows` rows."""

    def __init__(self, priority: int = 0, max_rows: int | None = None) -> None:
        self.priority, self.max_rows, self.calls = priority, max_rows, 0

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        if self.max_rows is not None and gate_up.shape[0] > self.max_rows:
            return None
        self.calls += 1
        return REFERENCES["silu_and_mul"](gate_up)

    @hookimpl
    def ember_kernel_ops(self, register):
        register("silu_and_mul", self.silu_and_mul, summary="counting", priority=self.priority)


def host_with(**plugins: object) -> PluginHost:
    host = PluginHost(entry_points=False, disabled=())
    for name, plugin in plugins.items():
        host.register(plugin, name)
    return host


def test_without_plugins_every_op_is_the_torch_reference() -> None:
    ops = KernelOps.from_plugins(host_with())
    assert ops == KernelOps.reference()  # the very same callables
    assert ops.describe() == {op: "torch" for op in REFERENCES}


def test_higher_priority_first_then_the_hooks_call_order() -> None:
    low, high, late = SiluPlugin(priority=0), SiluPlugin(priority=5), SiluPlugin(priority=0)
    ops = KernelOps.from_plugins(host_with(low=low, high=high, late=late))
    # Equal priorities: pluggy calls the plugin registered last first, as for every other hook.
    assert ops.describe()["silu_and_mul"] == "high:silu_and_mul > late:silu_and_mul > low:silu_and_mul > torch"
    ops.silu_and_mul(torch.randn(2, 8))
    assert (high.calls, late.calls, low.calls) == (1, 0, 0)


def test_a_declined_input_goes_to_the_next_impl_then_to_torch() -> None:
    picky, fallback = SiluPlugin(priority=1, max_rows=1), SiluPlugin(priority=0, max_rows=3)
    ops = KernelOps.from_plugins(host_with(picky=picky, fallback=fallback))
    x = torch.randn(5, 8)
    want = REFERENCES["silu_and_mul"](x)
    for rows, calls in ((1, (1, 0)), (3, (1, 1)), (5, (1, 1))):  # 5 rows: both decline, torch runs
        torch.testing.assert_close(ops.silu_and_mul(x[:rows]), want[:rows], rtol=0, atol=0)
        assert (picky.calls, fallback.calls) == calls


def test_not_implemented_and_false_decline_too() -> None:
    class Decliner:
        @hookimpl
        def ember_kernel_ops(self, register):
            register("write_kv", lambda *args: False)
            register("linear", lambda *args: NotImplemented)

    ops = KernelOps.from_plugins(host_with(decliner=Decliner()))
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    torch.testing.assert_close(ops.linear(x, w, None), x @ w.T)
    caches = (torch.zeros(2, 1, 4, 4), torch.zeros(2, 1, 4, 4))
    assert ops.write_kv(caches, torch.ones(1, 1, 4), torch.ones(1, 1, 4), torch.tensor([5]), None) is True
    assert caches[0][1, 0, 1].tolist() == [1.0] * 4  # the torch reference stored it at slot 5


def test_an_unknown_op_is_refused_naming_the_plugin() -> None:
    class Typo:
        @hookimpl
        def ember_kernel_ops(self, register):
            register("rmsnorm", lambda *args: None)

    with pytest.raises(PluginError, match=r"plugin 'typo': 'rmsnorm' is not a kernel op .*did you mean 'rms_norm'"):
        KernelOps.from_plugins(host_with(typo=Typo()))


def test_one_op_registered_twice_by_a_plugin_is_refused() -> None:
    class Twice:
        @hookimpl
        def ember_kernel_ops(self, register):
            register("rotary", lambda *args: None)
            register("rotary", lambda *args: None)

    with pytest.raises(PluginError, match="plugin 'twice' registers kernel op 'rotary' twice"):
        host_with(twice=Twice()).kernel_ops  # noqa: B018


def test_a_lazy_impl_that_resolves_to_none_is_skipped_and_a_non_callable_refused(monkeypatch) -> None:
    module = type(sys)("ember_test_lazy_ops")
    module.rms_norm = None  # e.g. its native library did not build here
    module.linear = 42
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class Lazy:
        def __init__(self, op: str) -> None:
            self.op = op

        @hookimpl
        def ember_kernel_ops(self, register):
            register(self.op, f"ember_test_lazy_ops:{self.op}")

    assert KernelOps.from_plugins(host_with(lazy=Lazy("rms_norm"))).describe()["rms_norm"] == "torch"
    with pytest.raises(PluginError, match=r"plugin 'lazy': kernel op 'linear' .* is int, not a callable"):
        KernelOps.from_plugins(host_with(lazy=Lazy("linear")))


def test_hook_ember_kernel_ops(use_plugins) -> None:
    # A third-party distribution (README.md's "ember-silu-count", pip-installed with its entry point) whose op the
    # engine runs: its counter moves by one call per layer per forward pass, and greedy output is unchanged.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "def fibonacci(n):\n    "
    default = LLM(EXAMPLE).generate([prompt], params)[0].token_ids
    use_plugins("silu-count")
    import ember_silu_count

    llm = LLM(EXAMPLE)
    chosen = llm.engine.kernel_ops.describe()["silu_and_mul"]
    assert chosen.startswith("silu-count:silu_and_mul > ") and chosen.endswith(" > torch")
    num_layers = llm.engine.hf_config["num_hidden_layers"]
    before = ember_silu_count.CALLS["silu_and_mul"]
    out = llm.generate([prompt], params)[0].token_ids
    calls = ember_silu_count.CALLS["silu_and_mul"] - before
    assert calls >= num_layers * params.max_tokens and calls % num_layers == 0  # >= 1 prefill + 15 decode steps
    assert out == default
