"""Medusa's heads and its draft-vocabulary rows of the LM head through the native CPU linears of `ember_kernels`
(option `native_draft`, medusa.py).

Why: at batch 1 on a CPU the heads' arithmetic is tiny (3 x 256 x 256 and 3 x 1024 x 256 multiply-adds on the
example), but inside the engine their float32 matrices (1.75 MB) no longer sit in the cache after the target's
pass streamed its own weights through it: measured in the engine, the heads took 86 us and the draft-vocabulary
logits 117 us a step (18 and 36 us run alone, warm), 12% of a ~1.9 ms step. In int8 (`native_draft_weights`, the
default: a scale per output row, packed in blocks of 16 outputs, and on a CPU with AVX512-VNNI W8A8) the matrices
are a quarter of the bytes; `float32` keeps them exact through the small-batch float32 kernel instead. Drafts may
differ from the float32 heads' at near-ties; the target verifies every draft, so outputs never do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FORMATS = ("int8", "float32")


class NativeMedusa:
    """The heads' residual blocks (every head's matrix stacked, one linear for all heads: they share their input)
    and, if given, the draft-vocabulary rows, in `weight_format`."""

    def __init__(self, head_weight: torch.Tensor, head_bias: torch.Tensor, rows: torch.Tensor | None,
                 weight_format: str) -> None:
        if weight_format not in FORMATS:
            raise ValueError(f"medusa's native heads keep their matrices in one of {FORMATS}, not {weight_format!r}")
        from ember_kernels.cpu.dense_linear import dense_linear
        from ember_kernels.cpu.draft_weights import pack_int8, packed_int8_linear

        self._dense_linear, self._pack_int8, self._packed_int8_linear = dense_linear, pack_int8, packed_int8_linear
        num_heads, hidden, _ = head_weight.shape
        self.hidden = hidden
        self.weight_format = weight_format
        self.bias = head_bias.detach().reshape(num_heads * hidden).float().contiguous()
        self.heads = self._kept(head_weight.detach().reshape(num_heads * hidden, hidden))
        self.rows = None if rows is None else self._kept(rows.detach())
        self.num_rows = 0 if rows is None else rows.shape[0]

    def _kept(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = weight.float().contiguous()
        return (weight, None) if self.weight_format == "float32" else self._pack_int8(weight)

    def _linear(self, x: torch.Tensor, kept: tuple[torch.Tensor, torch.Tensor | None],
                out_features: int) -> torch.Tensor:
        weight, scales = kept
        out: torch.Tensor | None
        if scales is None:
            out = self._dense_linear(x, weight[:out_features])
        else:
            out = self._packed_int8_linear(x, weight, scales, out_features, num_threads=torch.get_num_threads())
        if out is None:
            raise RuntimeError("the native CPU kernels became unavailable while medusa ran")
        return out

    def memory_bytes(self) -> int:
        tensors = [self.bias, *self.heads, *(self.rows or ())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def head_states(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[n, D] newest hidden states -> [num_heads, n, D]: each head's `h + SiLU(W_i h + b_i)`."""
        width = num_heads * self.hidden
        x = self._linear(hidden.float().contiguous(), self.heads, width) + self.bias[:width]
        return hidden + F.silu(x.view(hidden.shape[0], num_heads, self.hidden).transpose(0, 1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, D] -> [rows, N] over the draft vocabulary's rows (only where they were given)."""
        assert self.rows is not None
        return self._linear(x.contiguous(), self.rows, self.num_rows)
