"""The kernel-op table's contract: which ops model code calls, each op's signature, and how plugins register impls.

Model families call a few small ops many times a step (25 RMSNorms, 2 rotaries per layer, ...); at decode their
dispatch costs more than their arithmetic, so they are where a hardware-specific kernel pays. A plugin's
`ember_kernel_ops(register)` hook offers implementations:

    register("rms_norm", "my_plugin.kernels:rms_norm", summary="fused AVX-512 RMSNorm", priority=10)

`impl` is a callable with the op's signature below, or a "module:attr" string imported only when an engine builds
its table (so `ember plugins` imports no torch). A string that resolves to None means "not available on this
machine" (e.g. a native library that did not build), and the impl is skipped. Each engine builds its table once: per
op, the impls in descending `priority` (ties: the plugin called first by pluggy, i.e. registered last), then
the platform's plain-torch reference. At a call, an impl that does not take the inputs (another device, dtype or
layout, a tensor that needs gradients) *declines* by returning None, NotImplemented or False without touching
anything, and the next one runs; the reference takes everything. Ops are called with positional arguments.

This module is torch-free; the Protocols name torch types for readers and type checkers only.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ember.errors import PluginError
from ember.techniques import Technique

if TYPE_CHECKING:
    from torch import Tensor

KERNEL_OP_KIND = "kernel_op"  # the `kind` kernel-op impls carry where techniques are listed (`ember plugins`)
REGISTER_HOOK = "ember_kernel_ops"


class RmsNorm(Protocol):
    """h = x + residual (or x alone); returns (weight * RMSNorm(h), h): the residual add fused into the next norm.

    x, residual: [T, D]; weight: [D]. Normalize in float32 and multiply by the weight after casting back to x's
    dtype, as transformers does. h may be x itself when residual is None; the inputs are not modified.
    """

    def __call__(self, x: Tensor, weight: Tensor, eps: float,
                 residual: Tensor | None = None, /) -> tuple[Tensor, Tensor] | None: ...


class SiluAndMul(Protocol):
    """SwiGLU's activation: silu(gate) * up for gate_up [..., 2I] (gate first, as checkpoints pack it) -> [..., I]."""

    def __call__(self, gate_up: Tensor, /) -> Tensor | None: ...


class Rotary(Protocol):
    """Rotate x [T, H, hd] by cos, sin [T, hd], GPT-NeoX half split: x * cos + cat(-x2, x1) * sin.

    May work in place (then returns x itself, which may be a strided slice of a fused qkv output); returns the
    rotated tensor either way, and the caller uses that.
    """

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, /) -> Tensor | None: ...


class WriteKV(Protocol):
    """Store a step's new keys and values k, v [T, Hkv, D] (possibly strided slices of a fused qkv output) in
    kv_cache = (k_cache, v_cache), each [num_blocks, Hkv, block_size, D], at slot_mapping [T] int64
    (block_id * block_size + offset). `scratch` is the step's AttentionMetadata.scratch (per-step tensors derived
    once and reused by every layer). Returns True when written; a slot outside the cache raises IndexError.
    """

    def __call__(self, kv_cache: tuple[Tensor, Tensor], k: Tensor, v: Tensor, slot_mapping: Tensor,
                 scratch: dict[str, Any] | None = None, /) -> bool | None: ...


class Linear(Protocol):
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N]: meant for the few rows of decode and verification.

    An impl's output for a row must not depend on the other rows in the call (sequences batched, drafts verified).
    Prefill-sized inputs are best declined: a GEMM library is faster there.
    """

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, /) -> Tensor | None: ...


# The ops, in the order they are listed; each op name maps to its call signature.
KERNEL_OPS: dict[str, type] = {
    "rms_norm": RmsNorm,
    "silu_and_mul": SiluAndMul,
    "rotary": Rotary,
    "write_kv": WriteKV,
    "linear": Linear,
}


class RegisterKernelOp(Protocol):
    """The callback `ember_kernel_ops` receives."""

    def __call__(self, op: str, impl: Any, *, summary: str = "", priority: int = 0) -> None: ...


@dataclass(frozen=True, slots=True)
class KernelOpImpl:
    """One plugin's implementation of one op."""

    op: str
    impl: Any  # the callable, or a "module:attr" string
    plugin: str
    summary: str = ""
    priority: int = 0

    def technique(self) -> Technique:
        """This impl as a listed technique (kind "kernel_op", named after its op)."""
        return Technique(KERNEL_OP_KIND, self.op, self.impl, self.plugin, self.summary)

    def load(self) -> Callable[..., Any] | None:
        """The callable (importing a "module:attr" string now), or None where it is unavailable here."""
        loaded = self.technique().load()
        if loaded is not None and not callable(loaded):
            raise PluginError(f"plugin '{self.plugin}': kernel op '{self.op}' impl {self.impl!r} is "
                              f"{type(loaded).__name__}, not a callable")
        return loaded


class KernelOpRegistry:
    """Every kernel-op impl the plugins offer, by op, in the order an engine tries them."""

    def __init__(self) -> None:
        self._by_op: dict[str, list[KernelOpImpl]] = {op: [] for op in KERNEL_OPS}

    def add(self, impl: KernelOpImpl) -> None:
        if impl.op not in self._by_op:
            close = difflib.get_close_matches(impl.op, list(KERNEL_OPS), n=1)
            hint = f" — did you mean '{close[0]}'?" if close else ""
            raise PluginError(f"plugin '{impl.plugin}': '{impl.op}' is not a kernel op "
                              f"(kernel ops: {', '.join(KERNEL_OPS)}){hint}")
        if not isinstance(impl.priority, int) or isinstance(impl.priority, bool):
            raise PluginError(f"plugin '{impl.plugin}': kernel op '{impl.op}': priority must be an int, "
                              f"got {impl.priority!r}")
        if any(other.plugin == impl.plugin for other in self._by_op[impl.op]):
            raise PluginError(f"plugin '{impl.plugin}' registers kernel op '{impl.op}' twice")
        impls = self._by_op[impl.op]
        impls.append(impl)
        impls.sort(key=lambda i: -i.priority)  # stable: equal priorities keep the hook's call order

    def for_op(self, op: str) -> list[KernelOpImpl]:
        """The impls of `op`, first tried first (the torch reference, not listed, runs last)."""
        if op not in self._by_op:
            raise KeyError(f"'{op}' is not a kernel op (kernel ops: {', '.join(KERNEL_OPS)})")
        return list(self._by_op[op])

    def by_plugin(self, plugin: str) -> list[KernelOpImpl]:
        return [impl for impls in self._by_op.values() for impl in impls if impl.plugin == plugin]

    def describe(self) -> dict[str, str]:
        """Per op, the order an engine tries: e.g. {"rms_norm": "kernels-cpu:rms_norm > torch"} (an engine skips
        an impl that is unavailable on its machine; "torch" is the platform's reference)."""
        return {op: " > ".join([*(f"{i.plugin}:{op}" for i in impls), "torch"]) for op, impls in self._by_op.items()}


def collect_kernel_ops(impls: Iterable[tuple[str, Callable[..., Any]]]) -> KernelOpRegistry:
    """Call every `ember_kernel_ops` implementation, given as (plugin name, call) in pluggy's call order."""
    registry = KernelOpRegistry()
    for plugin_name, call in impls:
        def register(op: str, impl: Any, *, summary: str = "", priority: int = 0, _p: str = plugin_name) -> None:
            registry.add(KernelOpImpl(op, impl, _p, summary, priority))
        call(register=register)
    return registry
