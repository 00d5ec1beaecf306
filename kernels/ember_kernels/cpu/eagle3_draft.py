"""Python side of `eagle3_draft.c`: the EAGLE-3 head's catch-up and greedy chain for one request in one call."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ember_kernels.cpu.build import native_function
from ember_kernels.cpu.draft_weights import FORMATS, kept_matrix

_I64, _PTR, _INT, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_PTR, _INT, _PTR, _PTR, _F, _F, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64,
             _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _INT]
# The weights in the order the kernel reads them (its W_* enum).
WEIGHT_NAMES = ("fc", "input_layernorm", "hidden_norm", "qkv", "o_proj", "post_attention_layernorm", "gate_up",
                "down_proj", "norm", "lm_head", "embed")
MATRICES = ("fc", "qkv", "o_proj", "gate_up", "down_proj", "lm_head")  # kept in `weight_format`


def _function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native_function("ember_eagle3_draft", _ARGTYPES)  # type: ignore[return-value]


def eagle3_draft_available() -> bool:
    return _function() is not None


class Eagle3Kernel:
    """The head's weights bound once (float32 CPU tensors in `WEIGHT_NAMES` order); `draft` per request.

    dims: hidden, heads, KV heads, head size, intermediate size, draft vocabulary, target vocabulary.
    weight_format: how the matrices (`MATRICES`) are kept, one of `FORMATS`: bfloat16 halves what each draft
    position streams (eagle3_draft.c), int8 (symmetric, a scale per output row) quarters it.
    """

    def __init__(self, weights: Sequence[torch.Tensor], dims: Sequence[int], eps: float, scale: float,
                 draft_vocab: torch.Tensor, weight_format: str = "bfloat16") -> None:
        if len(weights) != len(WEIGHT_NAMES) or len(dims) != 7:
            raise ValueError(f"Eagle3Kernel takes {len(WEIGHT_NAMES)} weights and 7 dims")
        pairs = [kept_matrix("Eagle3Kernel", name, w, weight_format, MATRICES)
                 for name, w in zip(WEIGHT_NAMES, weights, strict=True)]
        kept, scales = [w for w, _ in pairs], [s for _, s in pairs]
        self.format = FORMATS.index(weight_format)
        self._weights = kept + [r for r in scales if r is not None]  # kept alive: the kernel reads them by address
        self._pointers = (ctypes.c_void_p * len(kept))(*(w.data_ptr() for w in kept))
        self._scales = (ctypes.c_void_p * len(kept))(*(None if r is None else r.data_ptr() for r in scales))
        self._dims = torch.tensor(list(dims), dtype=torch.int64)
        self._vocab = draft_vocab.to(torch.int64).contiguous()
        self.hidden_size = int(dims[0])
        self.eps, self.scale = float(eps), float(scale)

    def draft(self, aux: Sequence[torch.Tensor], start: int, count: int, next_ids: Sequence[int], cos: torch.Tensor,
              sin: torch.Tensor, first_position: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
              table: torch.Tensor, k: int, out: torch.Tensor,
              gaps: Sequence[tuple[int, int]] = ()) -> list[int] | None:
        """Rows start..start + count of the three aux tensors ([T, D] float32 contiguous) at positions
        first_position..: their K/V into the caches ([N, Hkv, S, hd] float32) through `table` (int32, the request's
        blocks), their outputs into `out` ([count, D] float32 contiguous, written); then k greedy drafts (target
        ids). cos/sin: [count + k - 1, hd] for the rows' then the chain's positions. gaps: position ranges
        [a, b) masked out of attention (never written). None if the kernel is unavailable or refused the arguments."""
        fn = _function()
        if fn is None:
            return None
        if len(next_ids) != count:
            raise ValueError(f"Eagle3Kernel.draft: {len(next_ids)} next ids for {count} rows")
        offset = start * self.hidden_size * 4
        # Small arguments as ctypes arrays: a torch tensor each would cost more than the kernel's arithmetic.
        ids = (ctypes.c_int64 * count)(*next_ids)
        flat = [p for gap in gaps for p in gap]
        gap_array = (ctypes.c_int64 * max(1, len(flat)))(*flat)
        tokens = (ctypes.c_int64 * max(1, k))()
        rc = fn(self._pointers, self.format, self._scales, self._dims.data_ptr(), self.eps, self.scale,
                aux[0].data_ptr() + offset, aux[1].data_ptr() + offset, aux[2].data_ptr() + offset, ids,
                cos.data_ptr(), sin.data_ptr(), count,
                first_position, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2], k_cache.shape[0],
                table.data_ptr(), table.shape[0], gap_array, len(gaps), k, self._vocab.data_ptr(), out.data_ptr(),
                tokens, torch.get_num_threads())
        return list(tokens[:k]) if rc == 0 else None
