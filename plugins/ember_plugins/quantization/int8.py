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
  dense GEMM beats the int8 kernel (int8pack on large prefills).
* native beyond a few rows: its 8-lane float32 FMAs fall behind a bf16 GEMM library (oneDNN's, avx512_bf16) from
  ~8 rows (0.5x at 16, 0.25x at 512 on llama-150m's shapes), so above `dense_threshold` rows it hands the batch
  to an int8 GEMM instead: each row of x quantized to int8 with its own scale (max|x| / 127), then
  `torch._int_mm` (oneDNN's VNNI int8 kernels: four multiply-adds per lane where bf16 does two), int32 sums
  scaled back per row and channel. Measured 2.2-2.4x the bf16 GEMM at 16-512 rows on an AVX-512 VNNI EPYC; no
  dequantized copy of the weights is made. Prefill chunks and large batches so run W8A8 (held-out loss: see
  bench/eval_int8_quality.py), decode weight-only. On CPUs with AMX-INT8 the int8 GEMM runs on the tile unit
  (`ember_amx_int8_gemm`, the same sums exactly); on one with AMX-BF16 alone, bf16 batches above `AMX_THRESHOLD`
  rows go to `amx_gemm` instead (weight-only, the weights widened exactly to bf16 in the tile layout).

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
from ember_kernels.cpu.quantized_linear import amx_gemm, amx_int8_available, int8_gemm
from ember_platform.api import UNQUANTIZED, Linear, LinearMethod, LinearSpec, Quantizer, skipped
from ember_plugins.quantization.options import INT8_KERNELS, check_int8
from ember_plugins.quantization.options import checked as checked_options

KERNELS = INT8_KERNELS
# Rows above which int8pack loses to a dense GEMM on the dequantized weights; fbgemm never did on the CPU
# measured (fp32 MKL runs 22 GFLOP/s there), so its default is no dense path.
INT8PACK_DENSE_THRESHOLD = 32
# Rows above which the native kernel hands a batch to the int8 GEMM (`int8_gemm`): where the two met on
# llama-150m's shapes (bench/bench_quantized_linear.py), on a 2-core AVX-512 EPYC.
# The int8 GEMM was ahead from 8 rows, bf16 and float32 activations alike.
NATIVE_GEMM_THRESHOLD = 4
# Rows above which the GEMM path runs `amx_gemm` (bf16 activations, weights widened exactly to bf16 in the tile
# unit's layout, weight-only) instead of the int8 GEMM, on CPUs with AMX-BF16 but not AMX-INT8 (none Intel sells:
# the two came together): there oneDNN's bf16 GEMM runs on the tile unit and torch._int_mm fell behind it on
# prefill chunks. With AMX-INT8 the int8 GEMM runs on the tile unit itself (TDPBSSD, twice TDPBF16PS's products)
# and beats both at every size above a few rows: on llama-150m's shapes, 2 threads, quiet Xeon (fastest of 3,
# bench_quantized_linear.py --paths), 1.51-1.96x dense at 8-2048 rows where amx_gemm ran 1.03-1.70x.
AMX_THRESHOLD = 64
NEVER = 1 << 62  # rows: the default AMX threshold where the int8 GEMM runs on AMX-INT8


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


def quantize_per_channel(weight: torch.Tensor, rows_per_chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (qweight [out, in] int8, scale [out] float32).

    A chunk of rows at a time, in place: quantizing on load runs this once per layer, and a float32 copy of a
    whole layer (and each temporary of the formula) would be the largest thing the load holds."""
    out_features = weight.shape[0]
    qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(out_features, dtype=torch.float32, device=weight.device)
    for start in range(0, out_features, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        w = weight[rows].detach().to(torch.float32, copy=True)  # a copy: never round the caller's tensor
        s = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # [rows]
        qweight[rows] = w.div_(s[:, None]).round_().clamp_(-127, 127)  # integral already: the cast is exact
        scale[rows] = s
    return qweight, scale


def _fbgemm_prepack(qweight: torch.Tensor, scale: torch.Tensor) -> Any:
    zero_points = torch.zeros(scale.shape, dtype=torch.long)
    with warnings.catch_warnings():
        # torch deprecates creating quantized tensors, but linear_prepack takes nothing else; when
        # it is removed, `fbgemm_available` turns false and "auto" never picks fbgemm.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qtensor = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zero_points, 0)
    return torch.ops.quantized.linear_prepack(qtensor, None)


class Int8LinearMethod(LinearMethod):
    """y = x @ (weight * weight_scale).T + bias, with weight: [out, in] int8 and weight_scale: [out] float32.

    `prequantized`: the layer loads those two tensors (a compressed-tensors int8 checkpoint, the engine's cache of
    quantized weights); else it loads a full-precision `weight` and quantizes it in `after_loading`, as soon as
    the loader has the layer complete (one full-precision layer in memory at a time)."""

    def __init__(self, kernel: str = "auto", dense_threshold: int | None = None, *, prequantized: bool = False,
                 default_dense: bool = True, amx_threshold: int | None = None) -> None:
        if kernel not in KERNELS:  # fail before any weights are loaded
            raise ValueError(f"[quantization] options: kernel '{kernel}' is not one of {', '.join(KERNELS)}")
        self.kernel, self.dense_threshold, self.prequantized = kernel, dense_threshold, prequantized
        self.default_dense = default_dense  # no dense_threshold given: int8pack's measured default applies
        self.amx_threshold = amx_threshold  # None: AMX_THRESHOLD (benches and tests force the paths with it)
        self.full_precision_until_loaded = not prequantized

    def create_weights(self, layer: Linear) -> None:
        shape = (layer.out_features, layer.in_features)
        if self.prequantized:
            layer.add_weight("weight", shape, torch.int8)
            layer.add_weight("weight_scale", (layer.out_features,), torch.float32)
        else:
            layer.add_weight("weight", shape, None)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Any) -> None:
        if name == "weight_scale" and loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]  # compressed-tensors stores channel scales as [out, 1]
        super().load_weight(layer, name, param, loaded, shard_id)

    def after_loading(self, layer: Linear) -> None:
        weight = layer.weight
        if self.prequantized:
            qweight, scale = weight.data, layer.weight_scale.data.float()
        else:
            qweight, scale = quantize_per_channel(weight.data)
        del layer.weight, weight  # the full-precision copy goes now, not at the end of the load
        kernel = resolve_kernel(self.kernel, qweight.device)
        # Aligned for every kernel (int8pack needs it, the others stream faster): a cache entry's tensors are not.
        layer.weight = nn.Parameter(aligned(qweight), requires_grad=False)
        layer.weight_scale = nn.Parameter(aligned(scale.to(qweight.device)), requires_grad=False)
        layer.kernel = kernel
        threshold = self.dense_threshold
        if threshold is None and self.default_dense:
            threshold = {"int8pack": INT8PACK_DENSE_THRESHOLD, "native": NATIVE_GEMM_THRESHOLD}.get(kernel)
        layer.dense_threshold = None if threshold is None or threshold < 0 else threshold
        layer.amx_threshold = self.amx_threshold if self.amx_threshold is not None else (
            NEVER if amx_int8_available() else AMX_THRESHOLD)
        layer._dense = None  # dequantized weight, made on the first large batch
        if kernel == "fbgemm":
            layer._packed = _fbgemm_prepack(layer.weight.cpu(), layer.weight_scale.cpu())
            # A constant extra row holding -1 and +1: see `_fbgemm_linear`.
            range_row = torch.zeros(1, layer.in_features)
            range_row[0, 0], range_row[0, 1] = -1.0, 1.0
            layer._range_row = range_row
        elif kernel == "int8pack":
            layer._scale_bf16 = aligned(layer.weight_scale.to(torch.bfloat16))  # int8pack wants the activations' dtype

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        shape, out_dtype = x.shape, x.dtype
        x2 = x.reshape(-1, layer.in_features)
        y: torch.Tensor | None
        rows = x2.shape[0]
        if layer.dense_threshold is not None and rows > layer.dense_threshold:
            y = None
            if layer.kernel == "native" and rows > layer.amx_threshold:  # None unless bf16 x on an AMX CPU
                y = amx_gemm(x2, layer.weight, layer.weight_scale, out_dtype)
            if y is None:
                y = (int8_gemm(x2, layer.weight, layer.weight_scale, out_dtype) if layer.kernel == "native"
                     else F.linear(x2, _dense_weight(layer, out_dtype)))
        elif layer.kernel == "native":
            y = int8_linear(x2, layer.weight, layer.weight_scale, out_dtype)
            if y is None:  # only if the library vanished after we chose it: stay correct
                y = F.linear(x2, _dense_weight(layer, out_dtype))
        elif layer.kernel == "fbgemm":
            y = _fbgemm_linear(layer, x2.float())
        else:
            # The kernel's fast path is bf16 activations on CPU: fp32 ones ran 2x slower, fp16 7x.
            y = torch._weight_int8pack_mm(aligned(x2.to(torch.bfloat16)), layer.weight, layer._scale_bf16)
        y = y.to(out_dtype)  # a no-op where the kernel wrote out_dtype already
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], layer.out_features)

    def describe(self, layer: Linear) -> str:
        kernel = getattr(layer, "kernel", self.kernel)
        dense = getattr(layer, "dense_threshold", None)
        gemm = "int8 GEMM (W8A8)" if kernel == "native" else "dense"
        dense_text = "" if dense is None else f", {gemm} above {dense} rows"
        return f"int8 per-channel, kernel={kernel}{dense_text}"


def _fbgemm_linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
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
    x_normed = torch.cat((layer._range_row, x / row_max))  # [1 + M, in], values in [-1, 1]
    y = torch.ops.quantized.linear_dynamic(x_normed, layer._packed, True)[1:]
    return y.mul_(row_max)


def _dense_weight(layer: Linear, dtype: torch.dtype) -> torch.Tensor:
    if layer._dense is None or layer._dense.dtype != dtype:
        layer._dense = (layer.weight.to(torch.float32) * layer.weight_scale[:, None]).to(dtype)
    return layer._dense


def Int8Linear(weight: torch.Tensor | None, bias: torch.Tensor | None, kernel: str = "auto",
               dense_threshold: int | None = None, *,
               quantized: tuple[torch.Tensor, torch.Tensor] | None = None, amx_threshold: int | None = None) -> Linear:
    """A standalone int8 `Linear` from full-precision `weight`, or from `quantized=(qweight, scale)` as given
    (views included: `after_loading` aligns them), without a checkpoint: for tests and benchmarks."""
    method = Int8LinearMethod(kernel, dense_threshold, prequantized=quantized is not None,
                              amx_threshold=amx_threshold)
    return standalone_linear(method, weight, bias, quantized)


def standalone_linear(method: LinearMethod, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      quantized: tuple[torch.Tensor, torch.Tensor] | None) -> Linear:
    """A `Linear` of `method` finished without a checkpoint: from full-precision `weight`, or from
    `quantized=(qweight, weight_scale)` as given (int8's and fp8's standalone layers)."""
    source = weight if quantized is None else quantized[0]
    assert source is not None
    layer = Linear(source.shape[1], source.shape[0], bias=bias is not None, ops=None, method=method)
    if quantized is None:
        layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    else:
        layer.weight = nn.Parameter(quantized[0], requires_grad=False)
        layer.weight_scale = nn.Parameter(quantized[1], requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    layer.finish_loading()
    return layer


class Int8Quantizer(Quantizer):
    """Options: `skip` (layers kept in full precision, by attribute name or module prefix; default ["lm_head"]);
    `kernel` ("auto": on CPUs native where the C kernels build, else fbgemm where torch has it, else int8pack; off
    the CPU int8pack); `dense_threshold` (rows above which the GEMM path runs: for native the int8 GEMM on
    per-row int8 activations, default NATIVE_GEMM_THRESHOLD; for int8pack dequantized dense weights, kept in
    memory once made, default 32; none for fbgemm; a negative value: never).

    It stores weights, so it comes last in a composition; the transforms before it (smoothing, rotation) rewrite
    the full-precision weight it then quantizes."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        checked = checked_options(check_int8, self.options)  # what ember checks a manifest with too (options.py)
        self.skip = checked["skip"]
        self.method = Int8LinearMethod(checked["kernel"], checked["dense_threshold"])
        self.restored = Int8LinearMethod(self.method.kernel, self.method.dense_threshold, prequantized=True)

    def linear_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        if inner is not UNQUANTIZED:
            raise ValueError(f"int8 stores the weights of {spec.prefix}, so it must be the last quantization method "
                             f"(after it comes {type(inner).__name__})")
        return inner if skipped(spec, self.skip) else self.method

    def restored_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        """What the int8 layers hold once loaded (int8 `weight`, `weight_scale`), for the quantized-weight cache."""
        return inner if skipped(spec, self.skip) else self.restored
