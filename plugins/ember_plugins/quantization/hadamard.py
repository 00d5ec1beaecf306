"""Seeded random orthogonal rotations built from Hadamard matrices, for `rotation` (QuaRot-style).

A rotation of size n = p * m, p the largest power of two dividing n and m the odd rest, is

    Q = diag(s) (R_m kron H_p)

with s a seeded vector of random signs, H_p the normalized Sylvester Hadamard matrix and R_m a seeded random
orthogonal m x m matrix (QR of a Gaussian matrix; the identity when m = 1). Why this shape: a Hadamard matrix
spreads one channel's outlier evenly over all p channels it mixes, which is what makes the rotated weights and
activations easy to quantize; Hadamard matrices exist only for sizes 1, 2 and multiples of 4, and for sizes with
an odd factor (tiny-llama's intermediate 688 = 16 * 43) QuaRot stores hand-built ones (172, 156, ...). The
Kronecker product with a small random orthogonal matrix is orthogonal for every n and still mixes all n channels,
at a cost of n * (p + m) multiply-adds per row, so it is cheap enough to apply online to activations.

A row vector x (indexed (i, j) -> i * p + j) times Q is R_m^T X H_p with X = (x * s) viewed as [m, p].
"""

from __future__ import annotations

import math

import torch

from ember_kernels.cpu.hadamard import hadamard_rotate

# The native kernel mixes the m blocks row by row (n * m multiply-adds per row), where torch's batched matmul is
# faster for a large odd factor: measured faster than torch at every row count for m = 11 (2816 = 11 * 256, 3-6x),
# slower from 64 rows for m = 43 (tiny-llama's 688 = 43 * 16).
NATIVE_MAX_ODD = 16


def hadamard(p: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of size p (a power of two): symmetric and orthogonal."""
    if p < 1 or p & (p - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, not {p}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < p:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(p)


def power_of_two_factor(n: int) -> int:
    """The largest power of two dividing n."""
    return n & -n


class RandomHadamard:
    """Q = diag(s) (R_m kron H_p) of size n (see the module docs), reproducible from (n, seed)."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"a rotation needs a positive size, not {n}")
        self.n, self.seed = n, seed
        self.p = power_of_two_factor(n)
        self.m = n // self.p
        # Seeded per size as well: two sizes with the same seed get unrelated rotations.
        g = torch.Generator().manual_seed(seed * 1_000_003 + n)
        self.signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
        self.h = hadamard(self.p)
        if self.m > 1:
            q, r = torch.linalg.qr(torch.randn(self.m, self.m, generator=g, dtype=torch.float64))
            self.r: torch.Tensor | None = q * torch.sign(torch.diagonal(r))  # Haar-distributed, unique
        else:
            self.r = None
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}

    def _factors(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        key = (device, dtype)
        if key not in self._cache:
            rt = self.r.T.contiguous() if self.r is not None else torch.empty(0)
            self._cache[key] = tuple(t.to(device=device, dtype=dtype) for t in (self.signs, self.h, rt))
        return self._cache[key]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x Q for x [..., n], computed in x's dtype (float32 or wider for weights; see `rotate_activations`)."""
        if x.shape[-1] != self.n:
            raise ValueError(f"rotation of size {self.n} applied to rows of {x.shape[-1]}")
        signs, h, rt = self._factors(x.device, x.dtype)
        v = (x * signs).reshape(*x.shape[:-1], self.m, self.p) @ h  # [..., m, p]
        if self.r is not None:
            v = rt @ v  # R_m^T X: mixes the m blocks
        return v.reshape(x.shape)

    def rotate_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x Q in float32 (or x's dtype when wider), returned in x's dtype: the online rotation of a layer's
        input, where a bf16 Hadamard would add rounding error of its own before quantization."""
        if x.is_cpu and x.dtype in (torch.bfloat16, torch.float32) and self.m <= NATIVE_MAX_ODD:
            # The fast Walsh-Hadamard kernel: the same float32 arithmetic up to summation order, n log2 p additions
            # per row where `rotate` runs a dense [p, p] matmul per block.
            signs, _, rt = self._factors(x.device, torch.float32)
            y = hadamard_rotate(x, signs, rt if self.r is not None else None, self.m, self.p)
            if y is not None:
                return y
        compute = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        return self.rotate(x.to(compute)).to(x.dtype)

    def matrix(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Q as a dense [n, n] matrix (the rows of the identity, rotated)."""
        return self.rotate(torch.eye(self.n, dtype=torch.float64)).to(dtype)
