"""Python side of `draft_llama.c`: a Llama draft model's catch-up pass and greedy chain for one request in one call."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ember_kernels.cpu.build import native_function
from ember_kernels.cpu.draft_weights import FORMATS, kept_matrix

_I64, _PTR, _INT, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_PTR, _PTR, _INT, _PTR, _F, _F, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64,
             _I64, _PTR, _INT]
MODEL_WEIGHTS = ("embed", "norm", "lm_head")  # then LAYER_WEIGHTS for each layer: the kernel's W_* and L_* order
LAYER_WEIGHTS = ("input_layernorm", "qkv", "o_proj", "post_attention_layernorm", "gate_up", "down_proj")
MATRICES = ("lm_head", "qkv", "o_proj", "gate_up", "down_proj")  # kept in `weight_format`


def _function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native_function("ember_draft_llama", _ARGTYPES)  # type: ignore[return-value]


def draft_llama_available() -> bool:
    return _function() is not None


class DraftLlamaKernel:
    """A Llama draft's weights bound once; `draft` per request and step.

    weights: name -> float32 CPU tensor for MODEL_WEIGHTS; layers: one such mapping per layer (LAYER_WEIGHTS; qkv and
    gate_up fused as the engine's layers keep them). dims: hidden, heads, KV heads, head size, intermediate size,
    vocabulary. weight_format: how the matrices are kept, one of FORMATS (bfloat16 halves what a draft position
    streams, int8 with a scale per output row quarters it).
    """

    def __init__(self, weights: dict[str, torch.Tensor], layers: Sequence[dict[str, torch.Tensor]],
                 dims: Sequence[int], eps: float, scale: float, weight_format: str = "int8") -> None:
        if weight_format not in FORMATS:
            raise ValueError(f"DraftLlamaKernel: weight_format must be one of {FORMATS}, got {weight_format!r}")
        if len(dims) != 6 or not layers:
            raise ValueError("DraftLlamaKernel takes 6 dims and at least one layer")
        named = [(n, weights[n]) for n in MODEL_WEIGHTS] + [(n, layer[n]) for layer in layers for n in LAYER_WEIGHTS]
        kept = [kept_matrix("DraftLlamaKernel", name, w, weight_format, MATRICES) for name, w in named]
        self._tensors = [t for pair in kept for t in pair if t is not None]  # alive: the kernel reads by address
        self._weights = (ctypes.c_void_p * len(kept))(*(w.data_ptr() for w, _ in kept))
        self._scales = (ctypes.c_void_p * len(kept))(*(None if s is None else s.data_ptr() for _, s in kept))
        self.format = FORMATS.index(weight_format)
        self._dims = torch.tensor([*dims, len(layers)], dtype=torch.int64)
        self.num_layers, self.head_dim = len(layers), int(dims[3])
        self.eps, self.scale = float(eps), float(scale)

    def draft(self, ids: Sequence[int], first_position: int, cos: torch.Tensor, sin: torch.Tensor,
              k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], table: torch.Tensor,
              k: int) -> list[int] | None:
        """The tokens `ids` at positions first_position.. (the ones the draft's cache lacks, the newest last): their
        K/V into each layer's caches ([N, Hkv, S, hd] float32 contiguous) through `table` (int32 contiguous, the
        request's blocks), then k >= 1 greedy drafts. cos/sin: [len(ids) + k - 1, hd] float32 contiguous for
        those positions. None if the kernel is unavailable or refused the arguments."""
        fn = _function()
        if fn is None:
            return None
        if len(k_caches) != self.num_layers or len(v_caches) != self.num_layers:
            raise ValueError(f"DraftLlamaKernel.draft: {len(k_caches)} caches for {self.num_layers} layers")
        count = len(ids)
        if cos.shape != (count + k - 1, self.head_dim) or sin.shape != cos.shape:
            raise ValueError(f"DraftLlamaKernel.draft: cos/sin of shape {tuple(cos.shape)}, expected "
                             f"{(count + k - 1, self.head_dim)}")
        # Small arguments as ctypes arrays: a torch tensor each would cost more than the kernel's arithmetic.
        id_array = (ctypes.c_int64 * count)(*ids)
        keys = (ctypes.c_void_p * self.num_layers)(*(c.data_ptr() for c in k_caches))
        values = (ctypes.c_void_p * self.num_layers)(*(c.data_ptr() for c in v_caches))
        tokens = (ctypes.c_int64 * k)()
        first = k_caches[0]
        rc = fn(self._weights, self._scales, self.format, self._dims.data_ptr(), self.eps, self.scale, id_array,
                count, first_position, cos.data_ptr(), sin.data_ptr(), keys, values, first.shape[2], first.shape[0],
                table.data_ptr(), table.shape[0], k, tokens, torch.get_num_threads())
        return list(tokens) if rc == 0 else None
