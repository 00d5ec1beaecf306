"""The built-in "kernels-cpu" plugin: the native CPU kernels as kernel ops, through the engine's table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ember.plugins import PluginHost
from ember_kernels.cpu import native_library_error
from ember_kernels.cpu.dense_linear import dense_linear, dense_linear_available
from ember_kernels.cpu.fused_ops import fused_ops_available
from ember_platform.engine.kernel_ops import REFERENCES, KernelOps

native = pytest.mark.skipif(not (fused_ops_available() and dense_linear_available()),
                            reason=f"native CPU kernels unavailable: {native_library_error()}")


def engine_ops() -> KernelOps:
    return KernelOps.from_plugins(PluginHost())


def test_plugin_module_does_not_import_torch_or_the_kernels() -> None:
    code = "import sys, ember_plugins.kernels; print(sorted(m for m in ('torch', 'ember_kernels') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_registers_every_op_lazily_and_is_listed() -> None:
    host = PluginHost()
    impls = host.kernel_ops.by_plugin("kernels-cpu")
    assert [i.op for i in impls] == ["rms_norm", "silu_and_mul", "rotary", "write_kv", "linear"]
    assert all(isinstance(i.impl, str) and i.priority == 0 for i in impls)
    listed = subprocess.run([sys.executable, "-m", "ember", "plugins", "--json"], capture_output=True, text=True,
                            check=True)
    kernels = next(p for p in json.loads(listed.stdout) if p["name"] == "kernels-cpu")
    assert [(t["kind"], t["name"]) for t in kernels["techniques"]] == [("kernel_op", i.op) for i in impls]


@native
def test_engine_table_tries_the_native_kernels_first() -> None:
    assert engine_ops().describe() == {op: f"kernels-cpu:{op} > torch" for op in REFERENCES}


def test_explain_shows_the_order_each_op_is_tried_in() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
    shown = subprocess.run([sys.executable, "-m", "ember", "explain", str(example), "--json"], capture_output=True,
                           text=True, check=True)
    assert json.loads(shown.stdout)["kernel_ops"] == {op: f"kernels-cpu:{op} > torch" for op in REFERENCES}


def test_native_kernels_off_leaves_the_torch_references() -> None:
    code = ("from ember.plugins import PluginHost; from ember_platform.engine.kernel_ops import KernelOps; "
            "import json; print(json.dumps(KernelOps.from_plugins(PluginHost()).describe()))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "EMBER_NATIVE_KERNELS": "0"})
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {op: "torch" for op in REFERENCES}


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_ops_match_the_torch_references(dtype: torch.dtype) -> None:
    ops, ref = engine_ops(), KernelOps.reference()
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
    weight = torch.randn(64, generator=gen).to(dtype)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    with torch.inference_mode():
        for res in (None, residual):
            got, want = ops.rms_norm(x, weight, 1e-5, res), ref.rms_norm(x, weight, 1e-5, res)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, **tol)
        gate_up = torch.randn(5, 128, generator=gen).to(dtype)
        torch.testing.assert_close(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **tol)
        # Rotary in place on a strided slice of a fused projection, as the model calls it.
        qkv = torch.randn(5, 3 * 4 * 16, generator=gen).to(dtype)
        q = qkv[:, :64].view(5, 4, 16)
        cos, sin = torch.randn(5, 16, generator=gen).to(dtype), torch.randn(5, 16, generator=gen).to(dtype)
        want = ref.rotary(q.clone(), cos, sin)
        got = ops.rotary(q, cos, sin)
        assert got is q  # rotated in place: no copy
        torch.testing.assert_close(got, want, **tol)


@native
def test_a_declined_input_falls_back_to_the_torch_reference() -> None:
    ops = engine_ops()
    x, weight = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)  # no native float64
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5, None)[0], REFERENCES["rms_norm"](x, weight, 1e-5)[0])
    # Autograd wanted: the forward-only kernels decline, torch runs and gradients flow.
    xg = torch.randn(3, 8, requires_grad=True)
    ops.rms_norm(xg, torch.ones(8), 1e-5, None)[0].sum().backward()
    assert xg.grad is not None


@native
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_model_linear_uses_the_native_kernel_for_few_rows(rows: int, with_bias: bool) -> None:
    from ember_platform.engine.models.layers import Linear
    from ember_plugins.kernels.cpu import NATIVE_LINEAR_MAX_ROWS

    layer = Linear(48, 24, bias=with_bias, ops=engine_ops()).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 48, generator=gen), torch.randn(24, 48, generator=gen), torch.randn(24)
    layer.weight.data.copy_(weight)
    if with_bias:
        layer.bias.data.copy_(bias)
    layer.finish_loading()  # as the loader does once a layer's tensors are in
    b = bias if with_bias else None
    with torch.inference_mode():
        out = layer(x.view(1, rows, 48))
    assert out.shape == (1, rows, 24)
    if rows <= NATIVE_LINEAR_MAX_ROWS:
        assert torch.equal(out.view(rows, 24), dense_linear(x, weight, b))
    else:
        assert torch.equal(out, F.linear(x, weight, b).view(1, rows, 24))
    # autograd still works (F.linear when a gradient is wanted)
    xg = x[:1].clone().requires_grad_(True)
    layer(xg).sum().backward()
    torch.testing.assert_close(xg.grad, weight.sum(0, keepdim=True))


@native
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
def test_a_bfloat16_model_linear_uses_the_native_kernel_for_fewer_rows(rows: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model's layers: the native kernel (float32 sums rounded once to bf16) up to its own, lower row limit,
    oneDNN's bf16 GEMM above it."""
    import ember_plugins.kernels.cpu as plugin
    from ember_kernels.cpu.dense_linear import dense_linear_bf16
    from ember_platform.engine.models.layers import Linear
    from ember_plugins.kernels.cpu import NATIVE_BF16_LINEAR_MAX_ROWS

    calls = []
    monkeypatch.setattr(plugin, "dense_linear_bf16", lambda *a: calls.append(a) or dense_linear_bf16(*a))

    layer = Linear(48, 24, bias=False, ops=engine_ops()).to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 48, generator=gen).bfloat16(), torch.randn(24, 48, generator=gen).bfloat16()
    layer.weight.data.copy_(weight)
    layer.finish_loading()
    with torch.inference_mode():
        out = layer(x.view(1, rows, 48))
    assert out.dtype == torch.bfloat16
    assert len(calls) == (rows <= NATIVE_BF16_LINEAR_MAX_ROWS)
    if calls:
        assert torch.equal(out.view(rows, 24), dense_linear_bf16(x, weight, None))
    else:
        assert torch.equal(out, F.linear(x, weight).view(1, rows, 24))
