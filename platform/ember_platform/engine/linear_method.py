"""Linear methods: how one linear layer stores, loads and computes with its weights (the quantization contract).

A model family builds every linear through one layer class, `Linear`, which holds only its shape (input size,
output shards) and bias, and delegates its tensors to a `LinearMethod` chosen per layer before loading
(`set_linear_methods`, on the meta device). So a quantization plugin decides, layer by layer:

    create_weights(layer)                the tensors a checkpoint in its format stores, with their names and
                                         dtypes (int8 `weight` + `weight_scale`, or a full-precision `weight`)
    load_weight(layer, name, param, loaded, shard_id)
                                         copy one checkpoint tensor in (q/k/v -> qkv_proj: its output rows)
    after_loading(layer)                 once the layer's tensors are all in: quantize, repack for a kernel
    apply(layer, x, bias)                the forward pass

The generic loader calls `after_loading` on each layer as soon as that layer's tensors are complete, so quantizing
on load holds one full-precision layer at a time, never the whole full-precision model.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ember_platform.engine.kernel_ops import KernelOps


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """What a linear layer is, for the factory that picks its method."""

    prefix: str  # the layer's module name in the model, e.g. "model.layers.0.self_attn.qkv_proj"
    in_features: int
    shards: tuple[tuple[Hashable | None, int], ...]  # output shards in output order: ((None, out),) if not packed
    bias: bool
    dtype: torch.dtype  # the model's compute dtype
    checkpoint_prefixes: tuple[str, ...]  # the checkpoint modules loaded into it, e.g. (...q_proj, ...k_proj, ...)

    @property
    def kind(self) -> str:
        """The layer's attribute name ("qkv_proj", "down_proj", "lm_head", ...): what skip lists name."""
        return self.prefix.rsplit(".", 1)[-1]

    @property
    def out_features(self) -> int:
        return sum(size for _, size in self.shards)


class LinearMethod(ABC):
    """How one layer's weights are stored, loaded and applied. One instance may serve many layers: keep per-layer
    state on the layer (its parameters and attributes), never on the method."""

    #: True when, until `after_loading`, the layer holds its full-precision `weight` [out, in] (a method that
    #: quantizes on load): a layer not yet finalized then computes with it, and a transform (rotation, smoothing)
    #: composed before this method may rewrite it. False for a method that loads pre-quantized tensors.
    full_precision_until_loaded: bool = True

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Register the layer's tensors on the meta device (`layer.add_weight`), named as the checkpoint names them
        under the layer's prefix (the loader maps `...q_proj.weight_scale` to `...qkv_proj.weight_scale`)."""

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Hashable | None) -> None:
        """Copy one checkpoint tensor into `param`: whole, or into the rows of output shard `shard_id`."""
        copy_shard(layer, param, loaded, shard_id)

    def after_loading(self, layer: Linear) -> None:  # noqa: B027 - optional
        """Called once, when all of the layer's tensors are loaded: quantize, repack for a kernel, free staging."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x W^T (+ bias) for x: [..., in] -> [..., out], in x's dtype."""

    def portable_tensors(self, layer: Linear) -> Mapping[str, torch.Tensor] | None:
        """The tensors a saved copy of this finished layer holds (the engine's quantized-weight cache, a package's
        `ember quantize` entry), when they are not the parameters it computes with: a kernel's layout chosen for
        this machine (int4's) is saved in a portable one, which the technique's `restored_method` loads back and
        repacks for the machine it runs on. None (the default): the layer's parameters as they are."""
        return None

    def describe(self, layer: Linear) -> str:
        return type(self).__name__


@contextlib.contextmanager
def portable_parameters(model: nn.Module) -> Iterator[None]:
    """While saving `model`: every layer whose method has `portable_tensors` holds those as its parameters (its
    bias kept) instead of its kernel's; put back on exit."""
    swapped: list[tuple[Linear, dict[str, nn.Parameter | None]]] = []
    try:
        for _, layer in linear_modules(model):
            tensors = layer.method.portable_tensors(layer) if layer.finalized else None
            if tensors is None:
                continue
            held = dict(layer._parameters)
            swapped.append((layer, held))
            for name, param in held.items():
                if param is not None and param is not layer.bias:
                    del layer._parameters[name]
            for name, tensor in tensors.items():
                layer._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        yield
    finally:
        for layer, held in swapped:
            layer._parameters.clear()
            layer._parameters.update(held)


LinearMethodFactory = Callable[[LinearSpec], LinearMethod]


class UnquantizedLinearMethod(LinearMethod):
    """A full-precision `weight` [out, in] in the model's dtype, through the kernel-op table's `linear`."""

    def create_weights(self, layer: Linear) -> None:
        layer.add_weight("weight", (layer.out_features, layer.in_features), None)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The `linear` kernel op: decode and speculative verification run a few rows, where a kernel that
        # streams the weights once for all rows beats a GEMM library (prefill-sized inputs go to F.linear).
        return layer.ops.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


def copy_into(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into `target` (a parameter or a slice of one) after checking its shape."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: the model expects {tuple(target.shape)}, "
                         f"the checkpoint has {tuple(loaded.shape)}")
    target.copy_(loaded)


def copy_shard(layer: Linear, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None) -> None:
    """Copy `loaded` into `param`, or into shard `shard_id`'s slice along the parameter's `output_dim` (divided by
    its `pack_factor` when several outputs share one element, as packed int4 columns do)."""
    if shard_id is None:
        copy_into(param.data, loaded)
        return
    if shard_id not in layer.shard_offsets:
        raise ValueError(f"unknown shard {shard_id!r}; this layer packs {list(layer.shard_offsets)}")
    dim = getattr(param, "output_dim", 0)
    if dim is None:  # one tensor for all shards (an input-side index): each shard's copy overwrites the last, so a
        # method whose shards could disagree checks them in its load_weight (gptq's g_idx)
        copy_into(param.data, loaded)
        return
    pack = getattr(param, "pack_factor", 1)
    offset, size = layer.shard_offsets[shard_id], layer.shard_sizes[shard_id]
    if offset % pack or size % pack:
        raise ValueError(f"shard {shard_id!r} ({size} outputs at {offset}) does not align with {pack} packed outputs")
    copy_into(param.data.narrow(dim, offset // pack, size // pack), loaded)


class Linear(nn.Module):
    """y = x W^T (+ b) over `out_features` outputs, or several linears over the same input fused into one
    (q/k/v, gate/up: `out_features` maps each checkpoint shard id to its output size, in output order; callers
    split the output by sizes they keep themselves). Its weights are its `method`'s; the bias is its own."""

    def __init__(self, in_features: int, out_features: int | Mapping[Hashable, int], bias: bool = False, *,
                 ops: KernelOps | None, method: LinearMethod = UNQUANTIZED) -> None:
        super().__init__()
        shards = dict(out_features) if isinstance(out_features, Mapping) else {None: int(out_features)}
        self.in_features, self.out_features = in_features, sum(shards.values())
        self.shard_sizes: dict[Hashable | None, int] = shards
        self.shard_offsets: dict[Hashable | None, int] = {}
        offset = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = offset
            offset += size
        self.ops = ops
        self.finalized = False
        self.bias = self._new_param((self.out_features,), None) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = lambda p, t, s=None: copy_shard(self, p, t, s)  # type: ignore[attr-defined]
        self.method = method
        method.create_weights(self)

    @property
    def is_packed(self) -> bool:
        return list(self.shard_sizes) != [None]

    def spec(self, prefix: str, dtype: torch.dtype, checkpoint_prefixes: tuple[str, ...] = ()) -> LinearSpec:
        return LinearSpec(prefix, self.in_features, tuple(self.shard_sizes.items()), self.bias is not None, dtype,
                          checkpoint_prefixes or (prefix,))

    def add_weight(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None, *, output_dim: int | None = 0,
                   pack_factor: int = 1) -> nn.Parameter:
        """Register tensor `name` of this layer's method on the meta device. `dtype` None: the model's compute dtype
        (set when the loader materializes it); else kept as given (int8 weights, float32 scales). `output_dim`: the
        dimension output shards slice (None: the same tensor for every shard); `pack_factor`: outputs per element
        along it. Its loader is the method's `load_weight`."""
        param = self._new_param(shape, dtype)
        param.output_dim = output_dim  # type: ignore[attr-defined]
        param.pack_factor = pack_factor  # type: ignore[attr-defined]
        param.weight_loader = lambda p, t, s=None: self.method.load_weight(  # type: ignore[attr-defined]
            self, name, p, t, s)
        self.register_parameter(name, param)
        return param

    @staticmethod
    def _new_param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=dtype or torch.float32, device="meta"), requires_grad=False)
        param.fixed_dtype = dtype is not None  # type: ignore[attr-defined]
        return param

    def set_method(self, method: LinearMethod) -> None:
        """Replace the method (before loading, on meta): its tensors replace the old method's."""
        if method is self.method:
            return
        for name, param in list(self._parameters.items()):
            if param is not None and param is not self.bias:
                del self._parameters[name]
        self.method = method
        method.create_weights(self)

    def frees_memory(self) -> bool:
        """Whether finalizing this layer frees what it loaded (a quantizing method drops the full-precision copy)."""
        return self.method.full_precision_until_loaded and self.method is not UNQUANTIZED

    def finish_loading(self) -> None:
        """The loader's call once every tensor of this layer is in (once; later calls do nothing)."""
        if not self.finalized:
            self.method.after_loading(self)
            self.finalized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.finalized:  # loaded but not finalized: calibration runs on the full-precision weight
            if not self.method.full_precision_until_loaded:
                raise RuntimeError(f"{self.method.describe(self)}: this layer holds stored (quantized) tensors and "
                                   "computes only once finalized; calibration needs full-precision methods")
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return self.method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        shards = f", shards={dict(self.shard_sizes)}" if self.is_packed else ""
        return (f"in={self.in_features}, out={self.out_features}{shards}, bias={self.bias is not None}, "
                f"method={self.method.describe(self)}")


def linear_modules(model: nn.Module) -> list[tuple[str, Linear]]:
    """Every `Linear` of `model` with its module name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]


def checkpoint_prefixes(model: nn.Module, prefix: str) -> tuple[str, ...]:
    """The checkpoint module names that load into layer `prefix` (the model's `packed_modules_mapping` read
    backwards: `...qkv_proj` <- `...q_proj`, `...k_proj`, `...v_proj`)."""
    parent, _, attr = prefix.rpartition(".")
    mapping: Mapping[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    sources = [ckpt for ckpt, (ours, _) in mapping.items() if ours == attr]
    return tuple(f"{parent}.{s}" if parent else s for s in sources) or (prefix,)


def set_linear_methods(model: nn.Module, factory: LinearMethodFactory, dtype: torch.dtype) -> dict[str, str]:
    """Give each `Linear` of a model still on the meta device the method `factory` picks for it; returns
    {layer name: method description} for the layers that changed. A layer tied to the embeddings (lm_head with
    tie_word_embeddings) keeps its shared full-precision weight."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    changed: dict[str, str] = {}
    for name, layer in linear_modules(model):
        weight = layer._parameters.get("weight")
        if weight is not None and counts[id(weight)] > 1:
            continue  # tied to another module's parameter
        method = factory(layer.spec(name, dtype, checkpoint_prefixes(model, name)))
        if method is not layer.method:
            layer.set_method(method)
            changed[name] = method.describe(layer)
    return changed


def finish_loading(model: nn.Module) -> None:
    """Finalize every linear layer not finalized yet (a loader that defers `after_loading`, e.g. for calibration)."""
    for _, layer in linear_modules(model):
        layer.finish_loading()
