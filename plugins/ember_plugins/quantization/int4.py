"""`int4`: group-wise 4-bit weights (groups of 32, 64 or 128 inputs, symmetric or asymmetric), with the matmul
kernel chosen for the device when a layer finishes loading.

Stable API (other techniques build on it: a GPTQ quantizer, rotations, mixed precision, checkpoint loaders):

* `Int4Weights(values, scales, zeros, group_size)`: one layer's quantized weights, W[n, k] =
  scales[n, g] * (values[n, k] - zeros[n, g]) with g = k // group_size. `values` uint8 [out, in], 0..15;
  `scales` float32 [out, groups]; `zeros` uint8 [out, groups], 0..15 (symmetric: all 8); groups =
  ceil(in / group_size), the last group shorter when group_size does not divide `in`. `.dequantize(dtype)`.
* `quantize_rtn(weight, group_size, symmetric) -> Int4Weights`: round to nearest. Symmetric: scale =
  max|w| / 7.5, zero 8 (GPTQ's `sym`: values -8..7 steps, every weight within half a step); asymmetric:
  scale = (max - min) / 15 over the group (0 always in range), zero = round(-min / scale).
* `pack_int4` / `unpack_int4`: values [out, in] <-> uint8 [out, ceil(in / 2)], the first of each pair in
  the low nibble (the canonical storage of the triton and dequant kernels).
* `Int4Method` (a `LinearMethod`): `install(layer, weights)` gives a layer its int4 weights in the layout of
  the kernel chosen for the layer's device, frees what the layer held, and sets `layer.kernel`; `apply` runs
  that kernel. Subclass it to load another layout (`gptq`, `compressed-tensors` do) and call `install` from
  `after_loading`. `Int4LinearMethod(group_size, symmetric, kernel)` quantizes a full-precision `weight` on
  load: override `quantize(layer, weight) -> Int4Weights` to quantize otherwise (GPTQ from calibration), or
  call `install` yourself. `Int4Linear(weights, bias, kernel)`: a standalone layer, for tests and benches.

Kernels (`kernel` option; "auto" picks per device):

* `native` (CPU, `ember_kernels.cpu.int4_linear`, C built on first use): activations quantized to int8 per
  row and per weight group (dynamic, symmetric), exact integer group dot products (AVX-512 VNNI, or AVX2),
  one float32 scale per group. Measured on a 2-core AVX-512 CPU at 1024x5632: 5-20x bf16 dense at 1-16
  rows, >= 1.1x at 32-64, 2.6x at 512 (bench/bench_int4.py); it is what "auto" picks at every batch size. On
  CPUs with AMX, where oneDNN's bf16 GEMM runs on the tile unit, bf16 batches above `AMX_ROWS` rows go to
  `amx_int4_linear` instead: weight-only, the weights dequantized to bf16 a block at a time in the tile layout.
* `int4pack` (CPU, `torch._weight_int4pack_mm_for_cpu`): weight-only, bf16 activations. Slower than bf16
  dense above ~16 rows, so larger inputs dequantize the weights into a dense matmul (`DENSE_ROWS`).
* `triton` (CUDA, `ember_kernels.triton.int4_matmul`): weights dequantized in the kernel, fp32 accumulation.
* `dequant`: the weights dequantized per call in the activations' dtype and one matmul: the reference.

`native` gives a row the same result whatever else is in the batch (batching and speculative verification
leave greedy output alone); `dequant` and `int4pack`'s dense path run torch matmuls, which do not promise it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember_kernels.cpu.fused_ops import gather_columns
from ember_kernels.cpu.int4_linear import amx_int4_linear, groups_of, int4_linear, int4_linear_available, int4_pack
from ember_kernels.cpu.quantized_linear import amx_available
from ember_platform.api import UNQUANTIZED, Linear, LinearMethod, LinearSpec, QuantizationError, Quantizer, skipped
from ember_plugins.quantization.options import INT4_DEFAULT_GROUP, INT4_GROUP_SIZES, INT4_KERNELS, check_int4
from ember_plugins.quantization.options import checked as checked_options

GROUP_SIZES = INT4_GROUP_SIZES
KERNELS = INT4_KERNELS
DEFAULT_GROUP = INT4_DEFAULT_GROUP
INT4PACK_GROUPS = (32, 64, 128, 256)  # what torch's int4pack kernel takes
DENSE_ROWS = 16  # int4pack: rows above which a dequantized dense matmul is faster (measured, bench_int4.py)
# native: rows above which bf16 activations go to the AMX tile unit (`amx_int4_linear`: weights dequantized to bf16
# a block at a time, weight-only) on CPUs with AMX, where oneDNN's bf16 GEMM runs on it too and the int8-activation
# VNNI kernel falls behind from a few dozen rows (measured on llama-150m's shapes, bench_quantized_linear.py --paths).
AMX_ROWS = 16
KERNEL_TENSORS = ("int4_packed", "int4_scales", "int4_zeros")  # what `install` registers on a layer


@dataclass(frozen=True)
class Int4Weights:
    """One layer's int4 weights (see the module docstring): W[n, k] = scales[n, g] * (values[n, k] - zeros[n, g])."""

    values: torch.Tensor  # uint8 [out, in], 0..15
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor  # uint8 [out, groups], 0..15
    group_size: int

    def __post_init__(self) -> None:
        out_features, in_features = self.values.shape
        shape = (out_features, groups_of(in_features, self.group_size))
        if tuple(self.scales.shape) != shape or tuple(self.zeros.shape) != shape:
            raise ValueError(f"Int4Weights: values {tuple(self.values.shape)} in groups of {self.group_size} need "
                             f"scales and zeros {shape}, got {tuple(self.scales.shape)} and "
                             f"{tuple(self.zeros.shape)}")

    @property
    def groups(self) -> int:
        return self.scales.shape[1]

    def group_index(self) -> torch.Tensor:
        return torch.arange(self.values.shape[1], device=self.values.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] in `dtype` (computed in float32)."""
        g = self.group_index()
        w = (self.values.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]
        return w.to(dtype)


def quantize_rtn(weight: torch.Tensor, group_size: int = DEFAULT_GROUP, symmetric: bool = True) -> Int4Weights:
    """Round-to-nearest int4 of `weight` [out, in] in groups of `group_size` inputs (see the module docstring)."""
    out_features, in_features = weight.shape
    groups = groups_of(in_features, group_size)
    padded = torch.zeros(out_features, groups * group_size, dtype=torch.float32, device=weight.device)
    padded[:, :in_features] = weight.detach().float()
    g = padded.view(out_features, groups, group_size)
    if symmetric:
        # Padding zeros do not change max|w|.
        scales = (g.abs().amax(dim=-1) / 7.5).clamp(min=1e-10)
        zeros = torch.full_like(scales, 8.0)
    else:
        # Min and max of the real inputs only (padding would pull the range to 0, which it includes anyway).
        lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
        if in_features % group_size:
            last = weight.detach().float()[:, (groups - 1) * group_size:]
            lo[:, -1], hi[:, -1] = last.amin(dim=-1).clamp(max=0), last.amax(dim=-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-10)
        zeros = torch.round(-lo / scales).clamp(0, 15)
    values = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, 15)
    return Int4Weights(values.view(out_features, -1)[:, :in_features].to(torch.uint8).contiguous(),
                       scales.contiguous(), zeros.to(torch.uint8).contiguous(), group_size)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[out, in] 0..15 -> uint8 [out, ceil(in / 2)]: value 2i in the low nibble of byte i, 2i + 1 in the high."""
    out_features, in_features = values.shape
    v = values.to(torch.uint8)
    if in_features % 2:
        v = torch.cat([v, torch.zeros(out_features, 1, dtype=torch.uint8, device=v.device)], dim=1)
    return (v[:, 0::2] | (v[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 [out, ceil(in / 2)] -> [out, in] 0..15."""
    both = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # [out, in / 2, 2]
    return both.reshape(packed.shape[0], -1)[:, :in_features].contiguous()


def triton_available() -> bool:
    """Whether the Triton int4 kernel can run here (triton installed, a CUDA device)."""
    try:
        from ember_kernels.triton import int4_matmul  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_kernel(kernel: str, device: torch.device, weights: Int4Weights) -> str:
    """The kernel "auto" stands for on `device` for these weights; a named kernel is checked and kept."""
    if kernel not in KERNELS:
        raise QuantizationError(f"quantization.options.kernel = {kernel!r}: int4 kernels are {', '.join(KERNELS)}")
    if kernel in ("native", "int4pack") and device.type != "cpu":
        raise QuantizationError(f"quantization.options.kernel = {kernel!r} runs on CPUs; this model is on "
                                f"{device.type}")
    if kernel == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise QuantizationError(f"quantization.options.kernel = 'triton' runs on CUDA GPUs (or with "
                                f"TRITON_INTERPRET=1); this model is on {device.type}")
    if kernel != "auto":
        return kernel
    if device.type == "cuda":
        return "triton" if triton_available() else "dequant"
    if device.type != "cpu":
        return "dequant"
    if weights.group_size % 8 == 0 and int4_linear_available():
        return "native"
    return "int4pack" if int4pack_fits(weights) else "dequant"


def prefill_rounds_activations(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether int4 layers with option `kernel` compute a prefill chunk (more than `AMX_ROWS` rows) of `dtype`
    activations on `device` as W4A8, each row's activations rounded to int8 per weight group (the native CPU
    kernel), rather than weight-only: what a calibration that measures the served model must imitate. bf16
    chunks on AMX CPUs go weight-only to the tile unit (`apply`)."""
    if kernel not in ("auto", "native") or device.type != "cpu" or not int4_linear_available():
        return False
    return dtype != torch.bfloat16 or not amx_available()


def int4pack_fits(weights: Int4Weights) -> bool:
    out_features, in_features = weights.values.shape
    return weights.group_size in INT4PACK_GROUPS and in_features % weights.group_size == 0 and out_features % 8 == 0


def _register(layer: Linear, name: str, tensor: torch.Tensor) -> None:
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


class Int4Method(LinearMethod):
    """int4 weights in the layout of a kernel chosen per layer when it is installed; `apply` runs that kernel.
    Subclasses say how the layer's tensors load (`create_weights`, `load_weight`) and call `install` from
    `after_loading`."""

    full_precision_until_loaded = False

    def __init__(self, kernel: str = "auto") -> None:
        if kernel not in KERNELS:  # fail before any weights are loaded
            raise QuantizationError(f"quantization.options.kernel = {kernel!r}: int4 kernels are "
                                    f"{', '.join(KERNELS)}")
        self.kernel = kernel

    def install(self, layer: Linear, weights: Int4Weights, input_order: torch.Tensor | None = None) -> None:
        """Give `layer` these weights in the chosen kernel's layout; every tensor it held but its bias goes.
        `input_order`: the weights' columns hold the inputs in this order (act-order GPTQ sorts them by group),
        so each forward pass reads x[..., input_order]; None: in order."""
        out_features, in_features = weights.values.shape
        if (out_features, in_features) != (layer.out_features, layer.in_features):
            raise ValueError(f"int4 weights [{out_features}, {in_features}] for a layer of "
                             f"[{layer.out_features}, {layer.in_features}]")
        device = weights.values.device
        kernel = resolve_kernel(self.kernel, device, weights)
        for name, param in list(layer._parameters.items()):
            if param is not None and param is not layer.bias:
                del layer._parameters[name]
        if kernel == "native":
            packed = int4_pack(weights.values.cpu(), weights.scales.cpu(), weights.zeros.cpu(), weights.group_size)
            if packed is None:  # the library vanished after "auto" chose it
                kernel = "dequant"
            else:
                for name, tensor in zip(KERNEL_TENSORS, packed, strict=True):
                    _register(layer, name, tensor)
        if kernel == "int4pack":
            if not int4pack_fits(weights):
                raise QuantizationError(f"quantization.options.kernel = 'int4pack': torch's int4pack kernel takes "
                                        f"groups of {INT4PACK_GROUPS} dividing the inputs, and outputs in "
                                        f"multiples of 8; {layer.in_features} inputs in groups of "
                                        f"{weights.group_size}, {layer.out_features} outputs do not fit")
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.values.to(torch.int32).cpu(), 1)
            scales = weights.scales.float().T  # [groups, out]
            # int4pack computes (q - 8) * scale + offset: the offset of zero point z is (8 - z) * scale.
            offsets = (8 - weights.zeros.float().T) * scales
            _register(layer, "int4_packed", packed)
            _register(layer, "int4_scales", torch.stack([scales, offsets], dim=-1).to(torch.bfloat16).contiguous())
        elif kernel in ("triton", "dequant"):
            _register(layer, "int4_packed", pack_int4(weights.values))
            _register(layer, "int4_scales", weights.scales.float().contiguous())
            _register(layer, "int4_zeros", weights.zeros.to(torch.uint8).contiguous())
        if input_order is not None:
            if sorted(input_order.tolist()) != list(range(in_features)):
                raise ValueError(f"int4: input_order is not a permutation of the {in_features} inputs")
            # int32: what the native column gather (`gather_columns`) reads; index_select takes it as well.
            _register(layer, "int4_input_order", input_order.to(device=device, dtype=torch.int32))
        layer.kernel = kernel
        layer.group_size = weights.group_size
        layer.symmetric = bool(torch.all(weights.zeros == 8))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, layer.in_features)
        order = layer._parameters.get("int4_input_order")
        if order is not None:
            x2 = in_input_order(x2, order)
        kernel = layer.kernel
        y: torch.Tensor | None = None
        if kernel == "native":
            if x2.shape[0] > getattr(layer, "amx_threshold", AMX_ROWS):  # None unless bf16 x on an AMX CPU
                y = amx_int4_linear(x2, layer.int4_packed, layer.int4_scales, layer.int4_zeros, layer.out_features,
                                    layer.group_size, dtype)
            if y is None:
                y = int4_linear(x2, layer.int4_packed, layer.int4_scales, layer.int4_zeros, layer.out_features,
                                layer.group_size, dtype)
        elif kernel == "int4pack":
            if x2.shape[0] > DENSE_ROWS:
                y = F.linear(x2, self.dense_weight(layer, dtype))
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), layer.int4_packed,
                                                                layer.group_size, layer.int4_scales)
        elif kernel == "triton":
            from ember_kernels.triton.int4_matmul import int4_matmul

            y = int4_matmul(x2, layer.int4_packed, layer.int4_scales, layer.int4_zeros, layer.group_size)
        if y is None:
            y = F.linear(x2, self.dense_weight(layer, dtype))
        y = y.to(dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], layer.out_features)

    def weights(self, layer: Linear) -> Int4Weights:
        """The layer's int4 weights back from its kernel's layout (for the dense paths and for inspection)."""
        if layer.kernel == "native":
            return _from_native(layer)
        if layer.kernel == "int4pack":
            return _from_int4pack(layer)
        return Int4Weights(unpack_int4(layer.int4_packed, layer.in_features), layer.int4_scales, layer.int4_zeros,
                           layer.group_size)

    def dense_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] in `dtype`, made per call (keeping it would hold a bf16 copy of every layer)."""
        if layer.kernel in ("triton", "dequant"):
            values = unpack_int4(layer.int4_packed, layer.in_features)
            g = torch.arange(layer.in_features, device=values.device) // layer.group_size
            scales = layer.int4_scales.to(dtype)[:, g]
            return (values.to(dtype) - layer.int4_zeros.to(dtype)[:, g]) * scales
        return self.weights(layer).dequantize(dtype)

    def describe(self, layer: Linear) -> str:
        kernel = getattr(layer, "kernel", self.kernel)
        group = getattr(layer, "group_size", None)
        kind = "" if not hasattr(layer, "symmetric") else " symmetric" if layer.symmetric else " asymmetric"
        return f"int4{kind}, group {group}, kernel={kernel}"


def in_input_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [rows, in] with its columns read in `order` (an act-order layer's input order, checked at `install`): the
    native gather on the CPU, which runs near copy speed where index_select along the columns does not."""
    gathered = gather_columns(x.contiguous(), order) if x.is_cpu else None
    return gathered if gathered is not None else x.index_select(1, order)


def _from_native(layer: Linear) -> Int4Weights:
    """Invert `int4_pack`'s layout (int4_linear.c)."""
    blocks, _ = layer.int4_packed.shape
    n, k, size = layer.out_features, layer.in_features, layer.group_size
    w = layer.int4_packed.view(blocks, -1, 16, 4)  # [blocks, Kp / 8, rows, 4]
    lo, hi = w & 0x0F, w >> 4
    values = torch.cat([lo, hi], dim=-1)  # [blocks, Kp / 8, rows, 8]: inputs 8j..8j+7 of each row
    values = values.permute(0, 2, 1, 3).reshape(blocks * 16, -1)[:n, :k]
    scales = layer.int4_scales.permute(0, 2, 1).reshape(blocks * 16, -1)[:n]
    sz = layer.int4_zeros.permute(0, 2, 1).reshape(blocks * 16, -1)[:n]
    zeros = torch.round(sz / scales.clamp(min=1e-30)).clamp(0, 15).to(torch.uint8)
    return Int4Weights(values.contiguous(), scales.contiguous(), zeros, size)


def _from_int4pack(layer: Linear) -> Int4Weights:
    eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
    scales_offsets = layer.int4_scales.float()  # [groups, out, 2]
    scales, offsets = scales_offsets[..., 0].T.contiguous(), scales_offsets[..., 1].T
    dense = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.int4_packed, layer.group_size,
                                                       layer.int4_scales).float().T  # [out, in]
    g = torch.arange(layer.in_features) // layer.group_size
    zeros = torch.round(8 - offsets / scales.clamp(min=1e-30)).clamp(0, 15)
    values = torch.round(dense / scales[:, g].clamp(min=1e-30) + zeros[:, g]).clamp(0, 15)
    return Int4Weights(values.to(torch.uint8), scales, zeros.to(torch.uint8), layer.group_size)


class Int4LinearMethod(Int4Method):
    """Loads a full-precision `weight` [out, in] and quantizes it once the layer is loaded (`quantize`, round to
    nearest by default): one full-precision layer in memory at a time; transforms composed before it (rotation,
    smoothing) rewrite that weight first."""

    full_precision_until_loaded = True

    def __init__(self, group_size: int = DEFAULT_GROUP, symmetric: bool = True, kernel: str = "auto") -> None:
        super().__init__(kernel)
        self.group_size, self.symmetric = group_size, symmetric

    def create_weights(self, layer: Linear) -> None:
        layer.add_weight("weight", (layer.out_features, layer.in_features), None)

    def quantize(self, layer: Linear, weight: torch.Tensor) -> Int4Weights:
        """The layer's int4 weights from its full-precision `weight`; override for another quantizer."""
        return quantize_rtn(weight, self.group_size, self.symmetric)

    def after_loading(self, layer: Linear) -> None:
        self.install(layer, self.quantize(layer, layer.weight.data))

    def portable_tensors(self, layer: Linear) -> Mapping[str, torch.Tensor]:
        return portable_int4(self, layer)


PORTABLE_TENSORS = ("int4_packed", "int4_scales", "int4_zeros")  # what a saved int4 layer holds, on any machine


def portable_int4(method: Int4Method, layer: Linear) -> dict[str, torch.Tensor]:
    """A finished int4 layer's weights in the triton / dequant kernels' layout (`pack_int4`'d values, float32
    scales, uint8 zeros), whatever kernel it computes with here: what the quantized-weight cache and `ember
    quantize` save, so that a machine with another kernel loads them too (`Int4StoredMethod`)."""
    weights = method.weights(layer)
    if layer._parameters.get("int4_input_order") is not None:
        raise QuantizationError("int4: a layer with an input order (act-order) has no portable int4 layout here")
    tensors = (pack_int4(weights.values), weights.scales.float(), weights.zeros.to(torch.uint8))
    return {name: t.contiguous() for name, t in zip(PORTABLE_TENSORS, tensors, strict=True)}


class Int4StoredMethod(Int4Method):
    """Loads what `portable_int4` saved (the engine's quantized-weight cache, a package's `ember quantize` entry)
    and installs it for this machine's kernel: no full-precision weight, no quantizing."""

    def __init__(self, group_size: int, kernel: str = "auto") -> None:
        super().__init__(kernel)
        self.group_size = group_size

    def create_weights(self, layer: Linear) -> None:
        groups = groups_of(layer.in_features, self.group_size)
        layer.add_weight("int4_packed", (layer.out_features, -(-layer.in_features // 2)), torch.uint8)
        layer.add_weight("int4_scales", (layer.out_features, groups), torch.float32)
        layer.add_weight("int4_zeros", (layer.out_features, groups), torch.uint8)

    def after_loading(self, layer: Linear) -> None:
        values = unpack_int4(layer.int4_packed.data, layer.in_features)
        weights = Int4Weights(values, layer.int4_scales.data.float().contiguous(),
                              layer.int4_zeros.data.contiguous(), self.group_size)
        if weights.zeros.numel() and int(weights.zeros.max()) > 15:
            raise QuantizationError(f"int4: saved zero points outside 0..15 ({int(weights.zeros.max())})")
        self.install(layer, weights)

    def portable_tensors(self, layer: Linear) -> Mapping[str, torch.Tensor]:
        return portable_int4(self, layer)


class _Prequantized(Int4Method):
    """A layer given its `Int4Weights` directly (`Int4Linear`)."""

    def create_weights(self, layer: Linear) -> None:
        pass


def Int4Linear(weights: Int4Weights, bias: torch.Tensor | None = None, kernel: str = "auto") -> Linear:
    """A standalone int4 `Linear` holding `weights` (kernel chosen for their device): for tests and benchmarks."""
    out_features, in_features = weights.values.shape
    method = _Prequantized(kernel)
    layer = Linear(in_features, out_features, bias=bias is not None, ops=None, method=method)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    method.install(layer, weights)
    layer.finalized = True
    return layer


class Int4Quantizer(Quantizer):
    """Options: `group_size` (32, 64 or 128; default 128), `symmetric` (true, default, or false), `skip` (layers
    kept in full precision, by attribute name or module prefix; default ["lm_head"]), `kernel` (auto, native,
    int4pack, triton, dequant; default auto). It stores weights, so it comes last in a composition."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        checked = checked_options(check_int4, self.options)  # what ember checks a manifest with too (options.py)
        self.skip = checked["skip"]
        self.method = Int4LinearMethod(checked["group_size"], checked["symmetric"], checked["kernel"])
        self.restored = Int4StoredMethod(checked["group_size"], checked["kernel"])

    def linear_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        if inner is not UNQUANTIZED:
            raise QuantizationError(f"int4 stores the weights of {spec.prefix}, so it must be the last quantization "
                                    f"method (after it comes {type(inner).__name__})")
        return inner if skipped(spec, self.skip) else self.method

    def restored_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        """What the int4 layers saved (`portable_int4`), loaded back into this machine's kernel."""
        return inner if skipped(spec, self.skip) else self.restored
