"""Python side of `paged_attention.c`: argument checks and the ctypes call."""

from __future__ import annotations

import ctypes

import torch

from ember_kernels.cpu.build import native_function

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGTYPES = [_PTR, _INT, _I64, _PTR, _PTR, _PTR, _INT, _PTR, _PTR, _PTR, _PTR, _INT,
             _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _INT]
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return native_function("ember_paged_attention", _ARGTYPES)  # type: ignore[return-value]


def paged_attention_available(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in _NATIVE_DTYPES and _function() is not None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def paged_attention(q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, first_block: torch.Tensor, end_block: torch.Tensor, *,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor | None:
    """Attention of padded short query runs over paged K/V read in place; None if unavailable.

    q: [B, Q, H, D] float32 or bfloat16 (other dtypes are converted to float32), each token's heads
    contiguous (a slice of a fused qkv output is taken as is); q_pos: [B, Q] int64 (-1 = padding
    query); caches: [N, Hkv, S, D] float32 or bfloat16; block_tables: [B, T] int32;
    first_block/end_block: [B] int64, the blocks each request reads. Returns a new [B, Q, H, D]
    tensor in q's dtype (float32 for others), computed in float32. CPU tensors only.
    """
    fn = _function()
    if fn is None or k_cache.dtype not in _NATIVE_DTYPES:
        return None
    batch, num_q, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    if q.dtype not in _NATIVE_DTYPES:
        q = q.float()
    # The kernel walks tokens by one stride with each token's H * D values contiguous.
    # (A size-1 dimension's stride is arbitrary, so it does not count.)
    token_stride = q.stride(1) if num_q > 1 else q.stride(0)
    if not ((q.stride(3) == 1 or head_dim == 1) and (q.stride(2) == head_dim or num_heads == 1)
            and (batch == 1 or num_q == 1 or q.stride(0) == num_q * q.stride(1))):
        q = q.contiguous()
        token_stride = num_heads * head_dim
    pos, tables = _as(q_pos, torch.int64), _as(block_tables, torch.int32)
    first, end = _as(first_block, torch.int64), _as(end_block, torch.int64)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention needs contiguous KV caches")
    out = torch.empty(q.shape, dtype=q.dtype)
    rc = fn(q.data_ptr(), q.dtype == torch.bfloat16, token_stride, pos.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.dtype == torch.bfloat16, tables.data_ptr(), first.data_ptr(), end.data_ptr(),
            out.data_ptr(), out.dtype == torch.bfloat16, batch, num_q, num_heads, num_kv_heads, head_dim,
            block_size, tables.shape[1], sliding_window or 0, scale, torch.get_num_threads())
    return out if rc == 0 else None


_WRITE_KV_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64]


def _token_stride(x: torch.Tensor) -> int | None:
    """The stride between tokens of x [T, H, D] whose (H, D) part is contiguous; None if it is not."""
    num_tokens, heads, dim = x.shape
    if (x.stride(2) != 1 and dim > 1) or (x.stride(1) != dim and heads > 1):
        return None
    return x.stride(0) if num_tokens > 1 else heads * dim


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Copy k, v [T, Hkv, D] into caches [N, Hkv, S, D] at `slot_mapping` [T] int64 (block * S + offset).

    True when done; False (nothing written) when the kernel cannot take the inputs: library unavailable,
    not all on the CPU, k/v not in the caches' dtype, a token's heads not contiguous, caches not
    contiguous. Raises IndexError for a slot outside the cache, as index_copy_ would.
    """
    fn = native_function("ember_write_kv", _WRITE_KV_ARGTYPES)
    if fn is None or not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and k.is_cpu and v.is_cpu
                          and k_cache.is_cpu and v_cache.is_cpu and k_cache.is_contiguous()
                          and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
                          and slot_mapping.is_contiguous() and k.shape == v.shape):
        return False
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    k_stride, v_stride = _token_stride(k), _token_stride(v)
    if k_stride is None or v_stride is None or k.shape[1:] != (num_kv_heads, head_dim) \
            or slot_mapping.shape != (k.shape[0],) or v_cache.shape != k_cache.shape:
        return False
    rc = fn(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), k_stride, v_stride,  # type: ignore[operator]
            slot_mapping.data_ptr(), k.shape[0], num_kv_heads, block_size, head_dim, num_blocks, k.element_size())
    if rc != 0:
        raise IndexError(f"write_kv: a slot in {slot_mapping.tolist()} is outside the cache of "
                         f"{num_blocks} blocks of {block_size}")
    return True
