"""Triton kernels, each beside a plain-PyTorch reference that its tests compare against."""
