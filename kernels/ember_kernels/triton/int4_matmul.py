"""Group-wise int4 weights times activations on the GPU: y[M, N] = x[M, K] @ W.T, W dequantized in the kernel.

W[n, k] = scales[n, g] * (q[n, k] - zeros[n, g]) with g = k // group_size; q packed two to a byte along k, the
first in the low nibble (`ember_plugins.quantization.int4.pack_int4`): [N, ceil(K / 2)] uint8, scales [N,
groups] float32, zeros [N, groups] uint8. Each program computes a BLOCK_M x BLOCK_N tile of y: per BLOCK_K step
it loads the tile's bytes (half the bytes of fp8, a quarter of bf16), unpacks and dequantizes them in registers
in the activations' dtype and accumulates a tl.dot in float32. Weights are read once per BLOCK_M rows, so decode
(M of 1..16) reads half a byte per weight; tiles grow with M so prefill chunks run as a dense GEMM would, with
the dequantization folded into the loads. Tile sizes depend on M, so on the GPU a row's result may differ in the
last bits with the batch it is in (the CPU kernels do not).

`int4_matmul_reference` is the same map in torch ops; the tests compare the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, groups, group_size,
                        stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wk_mask = n_ok[:, None] & k_ok[None, :]
        byte = tl.load(w_ptr + rn[:, None] * stride_wn + (rk[None, :] // 2), mask=wk_mask, other=0).to(tl.int32)
        q = (byte >> ((rk[None, :] % 2) * 4)) & 0xF  # [BLOCK_N, BLOCK_K]
        g = rk[None, :] // group_size
        s = tl.load(s_ptr + rn[:, None] * groups + g, mask=wk_mask, other=0.0)
        z = tl.load(z_ptr + rn[:, None] * groups + g, mask=wk_mask, other=0).to(tl.float32)
        w = ((q.to(tl.float32) - z) * s).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for M rows: thin tiles for decode, square ones for prefill chunks."""
    if m <= 16:
        return 16, 64, 128
    if m <= 64:
        return 64, 64, 64
    return 128, 128, 32


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype (float32 x: float32 dots)."""
    m, k = x.shape
    n, groups = scales.shape
    if packed.shape != (n, -(-k // 2)) or zeros.shape != (n, groups) or groups != -(-k // group_size):
        raise ValueError(f"int4_matmul: x {tuple(x.shape)} does not fit packed {tuple(packed.shape)}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)} in groups of {group_size}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k = _tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_matmul_kernel[grid](x, packed, scales, zeros, y, m, n, k, groups, group_size,
                              x.stride(0), packed.stride(0), y.stride(0),
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def int4_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """The same map in torch ops (float32)."""
    k = x.shape[1]
    q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)[:, :k].float()
    g = torch.arange(k, device=x.device) // group_size
    w = (q - zeros.float()[:, g]) * scales.float()[:, g]
    return (x.float() @ w.T).to(x.dtype)
