"""Native CPU kernels, compiled on first use with the machine's C compiler and loaded with ctypes.

Why C and not torch ops: paged decode attention in torch ops must gather every block it reads
into a contiguous tensor before a batched matmul can use it, which triples the memory traffic of
the one operation that is bound by memory traffic. A loop that reads the blocks in place through
the block table does not. The source is plain C with OpenMP (no Python or torch headers), so it
builds in about a second; the shared library is cached per source, compiler flags and CPU under
`$EMBER_KERNEL_CACHE` (default `~/.cache/ember/kernels`). Without a compiler, or with
`EMBER_NATIVE_KERNELS=0`, `paged_attention()` returns None and callers use their torch path.
"""

from __future__ import annotations

from ember_kernels.cpu.build import native_library_error
from ember_kernels.cpu.paged_attention import paged_attention, paged_attention_available

__all__ = ["native_library_error", "paged_attention", "paged_attention_available"]
