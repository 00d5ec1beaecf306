"""`fp8`: float8 e4m3 weights (`torch.float8_e4m3fn`), one float32 scale per output channel; weight-only on every
device, or W8A8 (fp8 activations too, scaled per token) through `torch._scaled_mm` on GPUs that compute in fp8.

e4m3 keeps 3 mantissa bits over a 4-bit exponent, so a weight's error is relative (at most 1/16 of itself)
rather than int8's absolute half step of the channel's largest weight: small weights next to large ones keep
their digits. Per channel, scale = max|w| / 448 (the largest finite e4m3), and the cast rounds to nearest.

Kernels, chosen per call by the rows of x (`dense_threshold`):

* CPU, few rows (decode, speculative verification): `ember_kernels.cpu.quantized_linear.fp8_linear`, a native
  kernel that streams the e4m3 bytes once for all rows and decodes them in registers by bit moves (no table);
  float32 accumulation, the same order whatever the batch.
* CPU, more rows of bf16 activations on a CPU with AMX (Sapphire Rapids and later): `amx_gemm`, blocks of 64
  weight rows widened exactly into bf16 straight into the tile unit's layout (in L2), TDPBF16PS with float32 sums.
  There oneDNN runs the dense bf16 GEMM on the tile unit too, 4-8x what `bf16_gemm` below reaches, so that kernel
  ran 0.2-0.6x dense at 8-1024 rows on llama-150m's shapes; `amx_gemm` 1.1-1.2x at 8-64 rows and 0.8-1.2x on
  prefill chunks (bench/bench_quantized_linear.py --paths, loaded machine: see bench/README.md).
* CPU, more rows of bf16 activations on a CPU with AVX512_BF16 but no AMX: `bf16_gemm`, tiles of
  12 weight rows widened exactly into bf16 in a per-thread buffer (in L2) and multiplied with vdpbf16ps (float32
  sums); no full-precision copy of the weights is kept. Measured 1.1-1.6x the bf16 dense GEMM at 8-64 rows, where
  the tiled path below ran 0.57-0.96x. On prefill chunks both run vdpbf16ps near its peak: since its output tiles
  are transposed in registers (not gathered) it ties oneDNN there, 1.01-1.04x at 256-2048 rows by one thread's CPU
  time (0.90-0.98x before; bench/bench_quantized_linear.py --threads 1 --cpu-time, bench/README.md).
* CPU, more rows otherwise (float32 activations, or no AVX512_BF16): `tiled_linear`, tiles of weights widened
  exactly into the activations' dtype in a cache-sized scratch buffer, multiplied by torch's GEMM, scaled per
  channel. No full-precision copy of the weights is ever kept.
* GPU, weight-only: the weights widened to the activations' dtype per call and torch's matmul (the cast is
  cheap next to the matmul there).
* GPU with compute capability >= 8.9, `activations = "fp8"`: each row of x quantized to e4m3 with its own
  scale (max|x| / 448), then `torch._scaled_mm` with row-wise scales (x's per token, the weights' per channel).
  Refused elsewhere, saying why: CPUs and older GPUs have no fp8 matmul units, and an emulation would be
  slower than the weight-only path while adding activation error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember_kernels.cpu.quantized_linear import (
    E4M3_MAX,
    amx_gemm,
    bf16_gemm,
    bf16_gemm_available,
    fp8_linear,
    fp8_linear_available,
    tiled_linear,
)
from ember_platform.api import (
    UNQUANTIZED,
    Linear,
    LinearMethod,
    LinearSpec,
    QuantizationContext,
    QuantizationError,
    Quantizer,
    copy_shard,
    skipped,
)
from ember_plugins.quantization.int8 import aligned, standalone_linear
from ember_plugins.quantization.options import check_fp8, checked

KERNELS = ("auto", "native", "torch")
ACTIVATIONS = ("none", "fp8")
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first NVIDIA GPUs with fp8 tensor cores
# Rows above which the CPU path leaves the native streaming kernel, by activation dtype: where the paths met on
# llama-150m's shapes (bench/bench_quantized_linear.py --methods fp8 --paths, 2-core AVX-512 EPYC, minimum of
# interleaved runs). bf16 (into `bf16_gemm`): the streaming kernel was ahead at 1, 2 and 4 rows (2.1x/2.0x/1.4x
# dense vs 1.1x/1.1x/1.2x), `bf16_gemm` from 8 (1.4x vs 0.9x). Float32 (into `tiled_linear`): the dense float32 side
# streams 4 bytes a weight, so the streaming kernel stays ahead up to 16 rows.
TILED_THRESHOLD = {torch.bfloat16: 4, torch.float32: 16}
AUTO = "auto"


def quantize_fp8_per_channel(weight: torch.Tensor, rows_per_chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [out, in] float8_e4m3fn, scale [out] float32), with scale = max|w| / 448 per row; a chunk of
    rows at a time, so that quantizing on load never holds a float32 copy of the whole layer."""
    qweight = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        w = weight[rows].detach().to(torch.float32, copy=True)
        s = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
        qweight[rows] = w.div_(s[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scale[rows] = s
    return qweight, scale


def check_w8a8_device(device: torch.device) -> None:
    """QuantizationError unless `device` runs fp8 matmuls (`torch._scaled_mm`): a CUDA GPU of compute
    capability >= 8.9."""
    where = "quantization.options.activations = \"fp8\" (W8A8 through torch._scaled_mm)"
    if device.type != "cuda":
        raise QuantizationError(f"{where} needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer); "
                                f"this model runs on {device.type}, which has no fp8 matmul: set activations = "
                                "\"none\" for fp8 weights with full-precision activations")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise QuantizationError(f"{where} needs compute capability >= 8.9; {torch.cuda.get_device_name(device)} "
                                f"has {capability[0]}.{capability[1]}: set activations = \"none\" (weight-only fp8)")


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: (x_fp8 [M, K], scale [M, 1] float32) with scale = max|x| / 448
    per row, so a row's numbers never depend on the rows batched with it."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def scaled_mm_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                     out_dtype: torch.dtype, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: x [M, K] quantized to e4m3 per token (or with the checkpoint's static `input_scale`), times
    qweight [N, K] e4m3 through `torch._scaled_mm` with row-wise scales: [M, 1] for x, [1, N] for the weights."""
    if input_scale is None:
        xq, x_scale = quantize_rows_fp8(x)
    else:
        x_scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        xq = (x.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=weight_scale.float().reshape(1, -1),
                            out_dtype=out_dtype)


class Fp8LinearMethod(LinearMethod):
    """y = x @ (weight * weight_scale).T + bias, with weight: [out, in] float8_e4m3fn and weight_scale: [out]
    float32. `prequantized`: the layer loads those tensors (a compressed-tensors fp8 checkpoint, the quantized-weight
    cache); else it loads the full-precision `weight` and quantizes it in `after_loading`. `tensor_scales`: the
    checkpoint has one scale per tensor, so a fused layer loads one per shard (q, k, v), spread over each shard's
    rows once loaded."""

    def __init__(self, kernel: str = "auto", dense_threshold: int | None = None, activations: str = "none", *,
                 prequantized: bool = False, static_input_scale: bool = False, tensor_scales: bool = False) -> None:
        if kernel not in KERNELS:
            raise QuantizationError(f"quantization.options.kernel = {kernel!r}: fp8 kernels are "
                                    f"{', '.join(KERNELS)}")
        if activations not in ACTIVATIONS:
            raise QuantizationError(f"quantization.options.activations = {activations!r}: fp8 takes "
                                    f"{', '.join(ACTIVATIONS)} (\"none\": weight-only, \"fp8\": W8A8)")
        self.kernel, self.dense_threshold, self.activations = kernel, dense_threshold, activations
        self.prequantized, self.static_input_scale = prequantized, static_input_scale
        self.tensor_scales = tensor_scales
        self.full_precision_until_loaded = not prequantized

    def create_weights(self, layer: Linear) -> None:
        shape = (layer.out_features, layer.in_features)
        if self.prequantized:
            layer.add_weight("weight", shape, torch.float8_e4m3fn)
            if self.tensor_scales:
                layer.add_weight("weight_scale", (len(layer.shard_sizes),), torch.float32, output_dim=None)
            else:
                layer.add_weight("weight_scale", (layer.out_features,), torch.float32)
            if self.static_input_scale:  # one per checkpoint shard, all of the same input: the largest is kept
                layer.add_weight("input_scale", (1,), torch.float32, output_dim=None)
        else:
            layer.add_weight("weight", shape, None)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Any) -> None:
        if name == "weight_scale" and self.tensor_scales:
            value = loaded.reshape(-1).float()
            if value.numel() != 1:
                raise QuantizationError(f"weight_scale of {value.numel()} values where the checkpoint's scheme "
                                        "(strategy \"tensor\") has one")
            param.data[list(layer.shard_sizes).index(shard_id)] = value[0]
            return
        if name == "weight_scale":
            loaded = loaded.reshape(-1).float()
        elif name == "input_scale":
            value = loaded.reshape(-1).float()
            if value.numel() != 1:
                raise QuantizationError(f"{layer.method.describe(layer)}: input_scale of {value.numel()} values; "
                                        "static activation scales are per tensor")
            seen = getattr(layer, "_input_scale_seen", False)
            param.data.copy_(torch.maximum(param.data, value) if seen else value)
            layer._input_scale_seen = True
            return
        copy_shard(layer, param, loaded, shard_id)

    def after_loading(self, layer: Linear) -> None:
        weight = layer.weight
        if self.prequantized:
            qweight, scale = weight.data, layer.weight_scale.data.float()
            if self.tensor_scales:  # one per shard -> one per output channel
                scale = torch.cat([s.expand(rows) for s, rows in zip(scale, layer.shard_sizes.values(), strict=True)])
        else:
            qweight, scale = quantize_fp8_per_channel(weight.data)
        del layer.weight, weight
        layer.weight = nn.Parameter(aligned(qweight), requires_grad=False)
        layer.weight_scale = nn.Parameter(aligned(scale.to(qweight.device)), requires_grad=False)
        device = qweight.device
        if self.activations == "fp8":
            check_w8a8_device(device)
            kernel = "scaled_mm"
        elif device.type == "cpu" and self.kernel in ("auto", "native") and fp8_linear_available():
            kernel = "native"
        elif self.kernel == "native":
            raise QuantizationError("quantization.options.kernel = \"native\": the native fp8 kernel runs on CPUs "
                                    f"with a C compiler; this layer is on {device.type} (use \"auto\")")
        else:
            kernel = "torch"
        layer.kernel = kernel
        threshold = self.dense_threshold
        layer.dense_threshold = AUTO if threshold is None else None if threshold < 0 else threshold

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        shape, out_dtype = x.shape, x.dtype
        x2 = x.reshape(-1, layer.in_features)
        y: torch.Tensor | None = None
        if layer.kernel == "native":
            threshold = layer.dense_threshold
            if threshold == AUTO:
                threshold = TILED_THRESHOLD.get(x2.dtype, TILED_THRESHOLD[torch.float32])
            if threshold is not None and x2.shape[0] > threshold:
                # amx_gemm: None unless x is bf16 on an AMX CPU; bf16_gemm: unless on an AVX512_BF16 one; else tiled
                y = amx_gemm(x2, layer.weight, layer.weight_scale, out_dtype)
                if y is None:
                    y = bf16_gemm(x2, layer.weight, layer.weight_scale, out_dtype)
                if y is None:
                    y = tiled_linear(x2, layer.weight, layer.weight_scale, out_dtype)
            else:
                y = fp8_linear(x2, layer.weight, layer.weight_scale, out_dtype)
        elif layer.kernel == "scaled_mm":
            y = scaled_mm_linear(x2, layer.weight, layer.weight_scale, out_dtype,
                                 getattr(layer, "input_scale", None))
        if y is None:  # the torch path, or the native library gone after we chose it: stay correct
            y = F.linear(x2, layer.weight.to(out_dtype)) * layer.weight_scale.to(out_dtype)
        y = y.to(out_dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], layer.out_features)

    def describe(self, layer: Linear) -> str:
        kernel = getattr(layer, "kernel", self.kernel)
        dense = getattr(layer, "dense_threshold", None)
        mode = "W8A8" if self.activations == "fp8" else "weight-only"
        rows = "rows by dtype" if dense == AUTO else f"{dense} rows"
        path = "bf16-dot GEMM (bf16 activations) or tiled GEMM" if bf16_gemm_available() else "tiled GEMM"
        gemm = "" if dense is None or kernel != "native" else f", {path} above {rows}"
        return f"fp8 e4m3 {mode} per-channel, kernel={kernel}{gemm}"


def Fp8Linear(weight: torch.Tensor | None, bias: torch.Tensor | None, kernel: str = "auto",
              dense_threshold: int | None = None, *,
              quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> Linear:
    """A standalone fp8 `Linear` from full-precision `weight` or from `quantized=(qweight, scale)`: for tests and
    benchmarks."""
    method = Fp8LinearMethod(kernel, dense_threshold, prequantized=quantized is not None)
    return standalone_linear(method, weight, bias, quantized)


class Fp8Quantizer(Quantizer):
    """Options: `skip` (layers kept in full precision; default ["lm_head"]); `kernel` ("auto": native on CPUs where
    the C kernels build, else torch); `dense_threshold` (rows above which the CPU path leaves the streaming kernel
    for a GEMM on widened tiles of weights: `bf16_gemm` for bf16 activations on AVX512_BF16 CPUs, else
    `tiled_linear`; default by activation dtype, `TILED_THRESHOLD`; negative: never);
    `activations` ("none": weight-only, the default; "fp8": W8A8 on GPUs of compute capability >= 8.9)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        checked(check_fp8, self.options)  # what ember checks a manifest with too (options.py); the checks below stay
        self.skip = tuple(self.options.get("skip", ("lm_head",)))
        threshold = self.options.get("dense_threshold")
        if threshold is not None and not isinstance(threshold, int):
            raise QuantizationError(f"quantization.options.dense_threshold = {threshold!r}: a whole number of rows")
        activations = str(self.options.get("activations", "none"))
        self.method = Fp8LinearMethod(str(self.options.get("kernel", "auto")), threshold, activations)
        self.restored = Fp8LinearMethod(self.method.kernel, threshold, activations, prequantized=True)

    def prepare(self, context: QuantizationContext) -> None:
        super().prepare(context)
        if self.method.activations == "fp8" and not torch.cuda.is_available():
            check_w8a8_device(torch.device("cpu"))  # refuses, before any weight is read

    def linear_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        if inner is not UNQUANTIZED:
            raise QuantizationError(f"fp8 stores the weights of {spec.prefix}, so it must be the last quantization "
                                    f"method (after it comes {type(inner).__name__})")
        return inner if skipped(spec, self.skip) else self.method

    def restored_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        return inner if skipped(spec, self.skip) else self.restored
