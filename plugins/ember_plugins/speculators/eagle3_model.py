"""The EAGLE-3 draft head (Li et al., 2025) as a plain module, shared by the `eagle3` speculator and its training
script (examples/train_eagle3.py), so the weights the script writes are the ones the engine runs.

One decoder layer on top of the target. `fc` fuses the target's low, middle and high hidden states (3D -> D); the
layer's attention reads the concatenation of the normed token embedding (the target's own embeddings) and the
normed hidden (2D -> q, k, v), its residual stream starts from that hidden, and its output (before the final norm)
is the hidden it is fed again for the next draft position. Logits come from the target's own LM head after the
head's final norm, restricted to the head's draft vocabulary (`draft_vocab`, a buffer of target token ids: the
tokens the target chooses most often, as in EAGLE-3), which makes both training and drafting cheaper; tokens outside
it are never drafted. The attention itself is not here: the engine runs it over a paged KV cache, training over dense
sequences with the training-time-test mask; both call `qkv` and `finish` around it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """Default (unscaled) RoPE for `positions` [T] -> cos, sin [T, head_dim], halves repeated (transformers' layout).
    The engine uses the target's own rotary module instead where it has one (it knows scaled variants)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, hd]; cos, sin: [T, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Eagle3Draft(nn.Module):
    """The head's weights and the computations around its attention (see the module docstring)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 rms_norm_eps: float, num_aux: int = 3, draft_vocab_size: int = 1) -> None:
        super().__init__()
        d = hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.fc = nn.Linear(num_aux * d, d, bias=False)
        self.input_layernorm = RMSNorm(d, rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(d, rms_norm_eps)  # on the fused (or fed-back) hidden
        self.q_proj = nn.Linear(2 * d, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * d, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * d, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, rms_norm_eps)
        self.gate_proj = nn.Linear(d, intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, d, bias=False)
        self.norm = RMSNorm(d, rms_norm_eps)
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab_size, dtype=torch.long))  # draft id -> target id
        # For inference (`prepare_inference`): fused q/k/v and gate/up weights, and the engine's kernel-op table.
        self._qkv: torch.Tensor | None = None
        self._gate_up: torch.Tensor | None = None
        self._ops: Any = None

    def prepare_inference(self, ops: Any = None) -> None:
        """Fuse the projections that read the same input (after the module reached its device and dtype) and run
        through `ops` (the target's kernel-op table: `linear`, `rms_norm`, `silu_and_mul`, `rotary`), so one draft
        row costs what a row of the target's own layers costs: a few calls, each the engine's fastest."""
        with torch.no_grad():
            self._qkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            self._gate_up = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self._ops = ops

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x) if self._ops is None else self._ops.rms_norm(x, norm.weight, norm.eps)[0]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight) if self._ops is None else self._ops.linear(x, weight)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[N, 3D] the target's low, middle and high hidden states, concatenated -> [N, D]."""
        return self._linear(aux, self.fc.weight)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """embeds, hidden: [N, D] -> q [N, H, hd], k and v [N, Hkv, hd], RoPE applied to q and k."""
        x = torch.cat([self._norm(self.input_layernorm, embeds), self._norm(self.hidden_norm, hidden)], dim=-1)
        n, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads  # x: [N, 2D]
        if self._qkv is None:
            q = apply_rope(self.q_proj(x).view(n, h, self.head_dim), cos, sin)
            k = apply_rope(self.k_proj(x).view(n, hkv, self.head_dim), cos, sin)
            return q, k, self.v_proj(x).view(n, hkv, self.head_dim)
        qkv = self._linear(x, self._qkv).view(n, h + 2 * hkv, self.head_dim)
        rotary = apply_rope if self._ops is None else self._ops.rotary
        qk = rotary(qkv[:, :h + hkv], cos, sin)  # q and k rotated together (in place where the kernel can)
        return qk[:, :h], qk[:, h:], qkv[:, h + hkv:]

    def finish(self, attention: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attention [N, H * hd], the input hidden [N, D] -> the layer's output [N, D] (fed back as the next hidden)."""
        if self._gate_up is None:
            h = hidden + self.o_proj(attention)
            x = self.post_attention_layernorm(h)
            return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        norm = self.post_attention_layernorm
        if self._ops is None:
            h = hidden + F.linear(attention, self.o_proj.weight)
            gate, up = F.linear(norm(h), self._gate_up).chunk(2, dim=-1)
            return h + F.linear(F.silu(gate) * up, self.down_proj.weight)
        x, h = self._ops.rms_norm(self._linear(attention, self.o_proj.weight), norm.weight, norm.eps, hidden)
        return h + self._linear(self._ops.silu_and_mul(self._linear(x, self._gate_up)), self.down_proj.weight)

    def logits_input(self, out: torch.Tensor) -> torch.Tensor:
        """What the target's LM head reads: the output, normed."""
        return self._norm(self.norm, out)
