"""The GPTQ algorithm (Frantar et al., 2022) and round-to-nearest, on one weight matrix: integer levels, scales and
zero points per group of input columns.

GPTQ quantizes the columns of W [out, in] one at a time and spreads each column's rounding error over the columns
not yet quantized, weighted by the inverse Hessian of the layer's reconstruction error, H = 2 X^T X over the
calibration inputs X [tokens, in]: the error it minimizes is ||W X^T - Q X^T||, what the layer's output loses,
rather than ||W - Q||, what round-to-nearest minimizes. Here:

* damping: `damp * mean(diag(H))` added to the diagonal, so that H is positive definite with few samples;
* dead inputs (a column whose input was always 0) are quantized as 0, their Hessian entry set to 1;
* act-order: columns in decreasing diag(H) order, the inputs that matter most first, while the most columns are
  left to absorb their error; groups are then contiguous in that order, and `g_idx` maps each input column back
  to its group (what a GPTQ checkpoint's `g_idx` holds);
* groups of `group_size` columns (<= 0: one group per output row) with their scale and zero point chosen when
  the first column of the group is reached, from the weights as the earlier errors left them;
* the error feedback in blocks of 128 columns: inside a block column by column, then one matmul for the rest.

Levels are unsigned, 0 .. 2^bits - 1, W ~ scale * (q - zero). Symmetric: zero = 2^(bits-1); 4 bits:
scale = max|w| / 7.5 (GPTQ's `sym`), 8 bits: max|w| / 127, levels 1..255 (the int8 layers' -127..127).
Asymmetric: the group's [min, max] (0 included) over 2^bits - 1 steps, the zero point never 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128  # columns per lazy-batch update (the paper's B)


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """W [out, in] ~ scales[:, g] * (q[:, c] - zeros[:, g]) with g = g_idx[c]."""

    q: torch.Tensor  # [out, in] int16, levels 0 .. 2^bits - 1
    scales: torch.Tensor  # [out, groups] float32
    zeros: torch.Tensor  # [out, groups] int16
    g_idx: torch.Tensor  # [in] int64: the group of each input column
    bits: int
    group_size: int  # <= 0: one group (per output row)
    symmetric: bool

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] as the levels say."""
        g = self.g_idx
        return ((self.q.float() - self.zeros.float()[:, g]) * self.scales[:, g]).to(dtype)


def num_groups(in_features: int, group_size: int) -> int:
    """Groups of `group_size` columns over `in_features` (the last one shorter when they do not divide)."""
    return 1 if group_size <= 0 else -(-in_features // group_size)


def grid(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [rows], zero [rows] float, integer-valued) of the quantization grid that covers each row of w."""
    maxq = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        # 8 bits: -127..127 around the zero (the int8 layers' range); fewer: GPTQ's `sym`, max|w| at 7.5 steps,
        # all 16 levels used (what int4's round-to-nearest does too, so the two compare on the same grid).
        scale = w.abs().amax(dim=1) / (half - 1 if bits == 8 else half - 0.5)
        zero = torch.full_like(scale, float(half))
    else:
        low = w.amin(dim=1).clamp(max=0.0)  # 0 on the grid: exact zeros (padding, pruned weights) stay exact
        high = w.amax(dim=1).clamp(min=0.0)
        scale = (high - low) / maxq
        zero = torch.round(-low / scale.clamp(min=1e-12))
        # No zero point of 0 (a row with no negative weight): the GPTQ format stores zero - 1. Zero 1 instead,
        # the scale stretched so that the largest weight still fits.
        no_negatives = zero < 1
        scale = torch.where(no_negatives, high / (maxq - 1), scale)
        zero = torch.where(no_negatives, torch.ones_like(zero), zero)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale represents it
    return scale, zero


def quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    symmetric: bool) -> torch.Tensor:
    """Levels of `w` on the grid (scale, zero), all [rows]; float, integer-valued. 8-bit symmetric grids leave
    level 0 unused, so that the levels map onto -127..127, what the int8 kernels store."""
    return torch.clamp(torch.round(w / scale) + zero, 1 if symmetric and bits == 8 else 0, 2**bits - 1)


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> QuantizedWeight:
    """Round-to-nearest: every weight to its group's nearest level (the baseline GPTQ improves on)."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    groups = num_groups(in_features, group_size)
    size = in_features if group_size <= 0 else group_size
    g_idx = torch.arange(in_features) // size
    q = torch.empty(w.shape, dtype=torch.int16)
    scales = torch.empty(out_features, groups)
    zeros = torch.empty(out_features, groups, dtype=torch.int16)
    for g in range(groups):
        cols = slice(g * size, (g + 1) * size)
        scale, zero = grid(w[:, cols], bits, symmetric)
        q[:, cols] = quantize_column(w[:, cols], scale[:, None], zero[:, None], bits, symmetric).to(torch.int16)
        scales[:, g], zeros[:, g] = scale, zero.to(torch.int16)
    return QuantizedWeight(q, scales, zeros, g_idx, bits, group_size, symmetric)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, *, bits: int, group_size: int, symmetric: bool,
                  act_order: bool, damp: float) -> QuantizedWeight:
    """GPTQ on W [out, in] given H [in, in] (see the module docstring). Raises ValueError when H is not positive
    definite even after damping (too little damping for the calibration data)."""
    w = weight.detach().to(torch.float32, copy=True)
    h = hessian.detach().to(torch.float64, copy=True)
    out_features, in_features = w.shape
    if h.shape != (in_features, in_features):
        raise ValueError(f"hessian {tuple(h.shape)} does not match a weight of {in_features} inputs")
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(in_features)
    w, h = w[:, perm], h[perm][:, perm]
    h.diagonal().add_(damp * torch.diagonal(h).mean())
    # The upper Cholesky factor of H^-1: row i holds what quantizing column i does to the columns after it.
    try:
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"the Hessian is not positive definite with damp = {damp}: raise damp ({e})") from None
    del h

    groups = num_groups(in_features, group_size)
    size = in_features if group_size <= 0 else group_size
    q = torch.empty(w.shape, dtype=torch.int16)
    scales = torch.empty(out_features, groups)
    zeros = torch.empty(out_features, groups)
    if group_size <= 0:  # one grid per row, from the weights as they are
        scales[:, 0], zeros[:, 0] = grid(w, bits, symmetric)
    for b0 in range(0, in_features, BLOCK):
        b1 = min(b0 + BLOCK, in_features)
        block = w[:, b0:b1]  # a view: updated in place as its columns are quantized
        errors = torch.empty_like(block)
        for i in range(b1 - b0):
            col = b0 + i
            g = col // size
            if group_size > 0 and col % size == 0:  # the group's grid, from its columns as updated so far
                scales[:, g], zeros[:, g] = grid(w[:, col:col + size], bits, symmetric)
            levels = quantize_column(block[:, i], scales[:, g], zeros[:, g], bits, symmetric)
            q[:, col] = levels.to(torch.int16)
            error = (block[:, i] - scales[:, g] * (levels - zeros[:, g])) / u[col, col]
            block[:, i:] -= error[:, None] * u[col, b0 + i:b1][None, :]
            errors[:, i] = error
        w[:, b1:] -= errors @ u[b0:b1, b1:]  # the block's errors, onto every later column at once

    inverse = torch.argsort(perm)
    g_idx = (torch.arange(in_features) // size)[inverse]  # processing position's group, by original column
    return QuantizedWeight(q[:, inverse].contiguous(), scales, zeros.to(torch.int16), g_idx, bits, group_size,
                           symmetric)


class HessianAccumulator:
    """H = 2 X^T X / N over input rows added in batches (float64: millions of rows sum without losing digits)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.num_rows = 0

    def add(self, x: torch.Tensor) -> None:
        """x: [..., in] inputs of the layer."""
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        self.sum.addmm_(x.T, x)
        self.num_rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.num_rows == 0:
            raise ValueError("no calibration inputs reached this layer")
        return self.sum * (2.0 / self.num_rows)
