"""Shared operands of the widened-weight GEMM tests (test_cpu_bf16_gemm.py, test_cpu_amx_gemm.py): both kernels
compute the same map, so they are checked on the same inputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def widened_gemm_operands(rows: int, out_features: int, in_features: int, kind: torch.dtype, seed: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 x [rows, in], int8 or e4m3 weights [out, in] (e4m3 across its range, subnormals included), scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    if kind == torch.int8:
        qweight = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    else:
        w = torch.randn(out_features, in_features, generator=gen) * torch.exp2(
            torch.randint(-10, 8, (out_features, 1), generator=gen).float())
        qweight = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    return x, qweight, torch.rand(out_features, generator=gen) * 0.01 + 1e-4


@pytest.fixture(name="operands")
def operands_fixture() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return widened_gemm_operands
