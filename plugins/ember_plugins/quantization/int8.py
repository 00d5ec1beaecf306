"""`int8`: int8 weights, one scale per output channel, with a matmul kernel chosen per machine.

Decode at small batch is bound by reading weights, so reading a quarter of the fp32 bytes (half
of bf16) is the whole win, if the kernel streams int8 at memory speed. Kernels, measured on a
2-core AVX2 CPU (int8 weight bytes per second over 4 layers of llama-150m; see the README of bench/):

* `native` (`ember_kernels.cpu.int8_linear`, C compiled on first use): weight-only, float32
  activations and accumulation. ~6.5-9 GB/s at 1-2 rows, ~4.5 at 4, ~2.4 at 8; beats fp32 MKL at
  every batch size measured, up to 64-row prefills.
* `fbgemm` (`quantized.linear_dynamic`): quantizes the activations too (W8A8), then an int8 GEMM.
  ~5 GB/s, almost flat from 1 to 8 rows, fastest at prefill sizes. We make each row's activation
  quantization independent of the other rows (see `_fbgemm_linear`). Held-out loss of the example
  model: +0.02% (weight-only: +0.001%), within the 2% budget (`bench/eval_int8_quality.py`).
* `int8pack` (`torch._weight_int8pack_mm`): weight-only, bf16 activations; ~2-3 GB/s at 1-4 rows,
  1.2 GB/s at 8. Works everywhere torch does (CUDA included). Its CPU kernel reads its operands with
  aligned vector loads, so it crashes the process (SIGSEGV) on an activation not 32-byte aligned or a
  weight not 16-byte aligned (torch 2.13, measured). Weights restored from the quantized-weight cache
  are views into one mmapped safetensors file, at whatever offset the file gives them, and activations
  can be views too; so every operand is handed to it at the allocator's 64-byte alignment (`aligned`).
* dense: the weights dequantized once and kept, for batches above `dense_threshold` rows, where a
  dense GEMM beats the int8 kernel (int8pack on large prefills; on this CPU never the others).

Every kernel gives a row the same result whatever else is in the batch, so batching and speculative
verification never change a request's numerics.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember_kernels.cpu.int8_linear import int8_linear, int8_linear_available
from ember_platform.api import Quantizer, linear_layers

KERNELS = ("auto", "native", "fbgemm", "int8pack")
# Rows above which int8pack loses to a dense GEMM on the dequantized weights; native and fbgemm
# never did on the CPU measured (fp32 MKL runs 22 GFLOP/s there), so their default is no dense path.
INT8PACK_DENSE_THRESHOLD = 32


def fbgemm_available() -> bool:
    """Whether this torch build has the fbgemm (x86) dynamic int8 linear."""
    engines = torch.backends.quantized.supported_engines
    return ("fbgemm" in engines or "x86" in engines) and hasattr(torch.ops.quantized, "linear_dynamic")


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """The kernel that "auto" stands for on `device`; a named kernel is checked and kept."""
    if kernel not in KERNELS:
        raise ValueError(f"[quantization] options: kernel '{kernel}' is not one of {', '.join(KERNELS)}")
    if kernel == "auto":
        if device.type != "cpu":
            return "int8pack"
        return "native" if int8_linear_available() else "fbgemm" if fbgemm_available() else "int8pack"
    return kernel


ALIGNMENT = 64  # bytes: what torch's CPU allocator gives every new tensor


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous and starting on an ALIGNMENT-byte boundary: itself when it already is, else a copy."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (qweight [out, in] int8, scale [out] float32)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # [out]
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _fbgemm_prepack(qweight: torch.Tensor, scale: torch.Tensor) -> Any:
    zero_points = torch.zeros(scale.shape, dtype=torch.long)
    with warnings.catch_warnings():
        # torch deprecates creating quantized tensors, but linear_prepack takes nothing else; when
        # it is removed, `fbgemm_available` turns false and "auto" never picks fbgemm.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qtensor = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zero_points, 0)
    return torch.ops.quantized.linear_prepack(qtensor, None)


class Int8Linear(nn.Module):
    """y = x @ (qweight * scale).T + bias, with qweight: [out, in] int8 and scale: [out]."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, kernel: str = "auto",
                 dense_threshold: int | None = None, *,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """From full-precision `weight`, or from an earlier result `quantized=(qweight, scale)` (a cache)."""
        super().__init__()
        if quantized is None:
            assert weight is not None
            qweight, scale = quantize_per_channel(weight)
        else:
            qweight, scale = quantized
            weight = qweight
        self.kernel = kernel = resolve_kernel(kernel, weight.device)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # Aligned for every kernel (int8pack needs it, the others stream faster): a cache entry's tensors are not.
        self.register_buffer("qweight", aligned(qweight.to(weight.device)))
        self.register_buffer("scale", aligned(scale.to(weight.device)))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.dense_threshold = dense_threshold
        self._dense: torch.Tensor | None = None  # dequantized weight, made on the first large batch
        if kernel == "fbgemm":
            self._packed = _fbgemm_prepack(qweight.cpu(), scale.cpu())
            # A constant extra row holding -1 and +1: see `_fbgemm_linear`.
            range_row = torch.zeros(1, self.in_features)
            range_row[0, 0], range_row[0, 1] = -1.0, 1.0
            self._range_row = range_row
        elif kernel == "int8pack":
            self._scale_bf16 = aligned(self.scale.to(torch.bfloat16))  # int8pack wants the activations' dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        shape, out_dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features)
        y: torch.Tensor | None
        if self.dense_threshold is not None and x2.shape[0] > self.dense_threshold:
            y = F.linear(x2, self._dense_weight(out_dtype))
        elif self.kernel == "native":
            y = int8_linear(x2, self.qweight, self.scale, out_dtype)
            if y is None:  # only if the library vanished after we chose it: stay correct
                y = F.linear(x2, self._dense_weight(out_dtype))
        elif self.kernel == "fbgemm":
            y = self._fbgemm_linear(x2.float())
        else:
            # The kernel's fast path is bf16 activations on CPU: fp32 ones ran 2x slower, fp16 7x.
            y = torch._weight_int8pack_mm(aligned(x2.to(torch.bfloat16)), self.qweight, self._scale_bf16)
        y = y.to(out_dtype)  # a no-op where the kernel wrote out_dtype already
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _fbgemm_linear(self, x: torch.Tensor) -> torch.Tensor:
        """fbgemm's dynamic linear, with each row's activations quantized on their own.

        linear_dynamic picks one activation scale and zero point from the min and max of the whole
        input, so one row's outlier would coarsen every other row's quantization: a request's
        numerics would depend on what it is batched with, and speculation (k + 1 rows of one request)
        could change a greedy result. So each row is divided by its own max |x| and a constant row
        (-1, +1, 0, ...) is appended: the input's min and max are then always exactly -1 and +1,
        the same quantization for every row whatever the batch, and the linear map lets us multiply
        each output row back by its max. `reduce_range` keeps activations to 7 bits so that AVX2's
        u8 x s8 pair sums cannot saturate int16.
        """
        # Few ops on purpose: at decode each is a fixed cost paid by every linear of every step.
        row_max = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True)  # [M, 1], max |x|
        row_max.clamp_min_(torch.finfo(torch.float32).tiny)
        x_normed = torch.cat((self._range_row, x / row_max))  # [1 + M, in], values in [-1, 1]
        y = torch.ops.quantized.linear_dynamic(x_normed, self._packed, True)[1:]
        return y.mul_(row_max)

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)
        return self._dense

    def extra_repr(self) -> str:
        dense = "" if self.dense_threshold is None else f", dense above {self.dense_threshold} rows"
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel, kernel={self.kernel}{dense}"


class Int8Quantizer(Quantizer):
    """Options: `skip` (module names kept in full precision, default ["lm_head"]); `kernel` ("auto":
    on CPUs native where the C kernels build, else fbgemm where torch has it, else int8pack; off the
    CPU int8pack); `dense_threshold` (rows above which dequantized dense weights are used, kept in
    memory once made; default 32 for int8pack, none for the others; a negative value: never)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.skip = tuple(self.options.get("skip", ("lm_head",)))
        self.kernel = str(self.options.get("kernel", "auto"))
        if self.kernel not in KERNELS:  # fail before any weights are loaded
            raise ValueError(f"[quantization] options: kernel '{self.kernel}' is not one of {', '.join(KERNELS)}")
        threshold = self.options.get("dense_threshold")
        self.dense_threshold = None if threshold is None else int(threshold)

    def quantize(self, model: nn.Module) -> nn.Module:
        for parent, name, layer in list(linear_layers(model, self.skip)):
            kernel = resolve_kernel(self.kernel, layer.weight.device)
            setattr(parent, name, Int8Linear(layer.weight, layer.bias, kernel, self._threshold(kernel)))
        return model

    def restore(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module | None:
        """Int8 layers straight from a saved state (the engine's quantized-weight cache): no quantizing."""
        names = {id(m): n for n, m in model.named_modules()}
        for parent, name, layer in list(linear_layers(model, self.skip)):
            prefix = names[id(layer)]
            qweight, scale = state.get(f"{prefix}.qweight"), state.get(f"{prefix}.scale")
            if qweight is None or scale is None:
                return None  # not a state this quantizer wrote: quantize instead
            kernel = resolve_kernel(self.kernel, qweight.device)
            bias = state.get(f"{prefix}.bias")
            setattr(parent, name, Int8Linear(None, bias, kernel, self._threshold(kernel), quantized=(qweight, scale)))
        return model

    def _threshold(self, kernel: str) -> int | None:
        if self.dense_threshold is None:
            return INT8PACK_DENSE_THRESHOLD if kernel == "int8pack" else None
        return None if self.dense_threshold < 0 else self.dense_threshold
