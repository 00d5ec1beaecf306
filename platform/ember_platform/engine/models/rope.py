"""Rotary position embeddings: the inverse frequencies of each `rope_type`, and each step's cos/sin.

Applying them to q and k is the kernel-op table's `rotary` (engine/kernel_ops.py has the torch reference).

Reads RoPE settings the way transformers 5.x standardizes them (`rope_parameters`), and also the
4.x spelling (`rope_theta` at the top, `rope_scaling` with `type` or `rope_type`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Mapping[str, Any], default_theta: float = 10_000.0) -> dict[str, Any]:
    """The standardized RoPE settings of a Hugging Face config dict (theta, type and scaling)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if any(isinstance(value, Mapping) for value in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported by this model family")
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    theta = params.get("rope_theta") or config.get("rope_theta") or default_theta
    params["rope_theta"] = float(theta)
    if params["rope_type"] == "llama3":
        # transformers prefers a top-level original_max_position_embeddings, then the dict's, then max positions.
        params["original_max_position_embeddings"] = (config.get("original_max_position_embeddings")
                                                      or params.get("original_max_position_embeddings")
                                                      or config["max_position_embeddings"])
    partial = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (rotary embeddings on every dim only)")
    return params


def inverse_frequencies(params: Mapping[str, Any], head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies for `params` (from `rope_parameters`)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type '{rope_type}' is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) for a step's positions once; every layer then applies them to q and k.

    cos/sin come from the positions directly (no table sized by max_position_embeddings) in
    float32, then are cast to the activations' dtype, exactly as transformers does.
    """

    def __init__(self, head_dim: int, params: Mapping[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_type = params["rope_type"]
        # A plain attribute, not a buffer: built on the CPU even while the model is built on the
        # meta device, and never cast to the model dtype.
        self.inv_freq = inverse_frequencies(params, head_dim)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, head_dim]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

