"""Native CPU kernels, compiled on first use with the machine's C compiler and loaded with ctypes.

Why C and not torch ops: paged decode attention in torch ops must gather every block it reads
into a contiguous tensor before a batched matmul can use it, which triples the memory traffic of
the one operation that is bound by memory traffic. A loop that reads the blocks in place through
the block table does not. The same holds for decode's other small steps: int8 and small-batch
linears stream weights once for every row, and `fused_ops` does RMSNorm, rotary and SiLU-and-mul in
one call each where torch takes 3-10 ops (at batch 1 their dispatch costs more than their
arithmetic). Each kernel does its torch formula's arithmetic with the same roundings; the torch
formulas stay as the fallback and the reference the tests hold them to. The source is plain C
with OpenMP (no Python or torch headers), so it builds in a few seconds; the shared library is
cached per source, compiler flags and CPU under `$EMBER_KERNEL_CACHE` (default
`~/.cache/ember/kernels`). Without a compiler, or with `EMBER_NATIVE_KERNELS=0`,
`paged_attention()` returns None and callers use their torch path.
"""

from __future__ import annotations

from ember_kernels.cpu.build import native_library_error
from ember_kernels.cpu.paged_attention import paged_attention, paged_attention_available

__all__ = ["native_library_error", "paged_attention", "paged_attention_available"]
