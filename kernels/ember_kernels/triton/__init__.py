"""Triton GPU kernels (importable without a GPU; they run on CUDA, or on CPU under TRITON_INTERPRET=1 for tests)."""
