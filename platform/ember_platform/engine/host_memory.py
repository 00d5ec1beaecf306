"""Give a CPU tensor's physical memory back to the OS without freeing the tensor (Linux `madvise(MADV_DONTNEED)`).

On private anonymous memory, which is what large CPU tensors live in, the released pages read as zeros the next
time they are touched and only then take memory again. For a sleeping engine's KV cache that is exactly right: the
memory goes back at once, and waking costs nothing up front (no reallocation, no zero-filling gigabytes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Iterable

import torch

MADV_DONTNEED = 4
_libc: ctypes.CDLL | None = None


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def release_pages(tensors: Iterable[torch.Tensor]) -> int | None:
    """Release the whole pages inside each contiguous CPU tensor; returns the bytes released, or None when this
    platform cannot (the caller then frees and reallocates instead). The tensors stay valid: released pages read
    as zeros, the partial pages at either end keep their contents."""
    madvise = _madvise()
    if madvise is None:
        return None
    page = mmap.PAGESIZE
    released = 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        first, last = -(-start // page) * page, end // page * page
        if last <= first:
            continue
        if madvise(first, last - first, MADV_DONTNEED) != 0:
            return None
        released += last - first
    return released


def trim_heap() -> None:
    """Return the C heap's free pages to the OS (glibc `malloc_trim`); a no-op elsewhere.

    Tensors under glibc's mmap threshold, which it raises to 32 MiB after the first large free, come from the heap,
    and freed heap memory stays in the process: quantizing on load frees a full-precision layer and its float32
    temporaries at each layer, and without this the freed layers added up (a 90M-parameter load peaked ~400 MiB
    higher than the full-precision load it replaces)."""
    if not sys.platform.startswith("linux"):
        return
    global _libc
    if _libc is None:
        _madvise()
    trim = getattr(_libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is not None:
        trim(0)
