"""The Triton int4 kernel computes its torch reference, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1,
in a fresh process: the variable is read when the kernel is defined). Small shapes: interpreting is slow."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from ember_kernels.triton.int4_matmul import int4_matmul, int4_matmul_reference
    from ember_plugins.quantization.int4 import Int4Linear, pack_int4, quantize_rtn

    gen = torch.Generator().manual_seed(0)
    # (rows, outputs, inputs, group): ragged edges in every dimension, a short last group, each tile size.
    for m, n, k, group in [(3, 40, 100, 32), (20, 72, 64, 16), (70, 24, 48, 32)]:
        for symmetric in (True, False):
            q = quantize_rtn(torch.randn(n, k, generator=gen), group, symmetric)
            x = torch.randn(m, k, generator=gen)
            args = (pack_int4(q.values), q.scales, q.zeros, group)
            y, expected = int4_matmul(x, *args), int4_matmul_reference(x, *args)
            assert y.shape == (m, n) and y.dtype == torch.float32
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(expected, x @ q.dequantize().T, rtol=1e-5, atol=1e-4)
    # Through the int4 layer: its "triton" kernel, bias and leading dimensions.
    q = quantize_rtn(torch.randn(40, 64, generator=gen), 32, False)
    bias = torch.randn(40, generator=gen)
    layer = Int4Linear(q, bias, "triton")
    assert layer.kernel == "triton"
    x = torch.randn(2, 3, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ q.dequantize().T + bias, rtol=1e-5, atol=1e-4)
    print("ok")
""")


def test_the_triton_kernel_computes_its_reference_interpreted() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
