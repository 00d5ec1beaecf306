"""Python side of `paged_attention.c`: argument checks and the ctypes call."""

from __future__ import annotations

import ctypes

import torch

from ember_kernels.cpu.build import native_function

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, ctypes.c_int, _PTR, _PTR, _PTR, _PTR,
             _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int]


def _function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native_function("ember_paged_attention", _ARGTYPES)  # type: ignore[return-value]


def paged_attention_available(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in (torch.float32, torch.bfloat16) and _function() is not None


def paged_attention(q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, first_block: torch.Tensor, end_block: torch.Tensor, *,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor | None:
    """Attention of padded short query runs over paged K/V read in place; None if unavailable.

    q: [B, Q, H, D] float32; q_pos: [B, Q] int64 (-1 = padding query); caches: [N, Hkv, S, D]
    float32 or bfloat16; block_tables: [B, T] int32; first_block/end_block: [B] int64, the blocks
    each request reads. Returns [B, Q, H, D] float32. CPU tensors only.
    """
    fn = _function()
    if fn is None or k_cache.dtype not in (torch.float32, torch.bfloat16):
        return None
    batch, num_q, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    args = [t.contiguous() for t in (q.float(), q_pos.long(), block_tables.int(), first_block.long(),
                                     end_block.long())]
    q32, pos, tables, first, end = args
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention needs contiguous KV caches")
    out = torch.empty_like(q32)
    rc = fn(q32.data_ptr(), pos.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16), tables.data_ptr(), first.data_ptr(), end.data_ptr(),
            out.data_ptr(), batch, num_q, num_heads, num_kv_heads, head_dim, block_size, tables.shape[1],
            sliding_window or 0, scale, torch.get_num_threads())
    return out if rc == 0 else None
