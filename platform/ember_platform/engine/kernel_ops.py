"""The kernel-op table an engine builds once from its plugins and gives to model construction.

`KernelOps.from_plugins(host)` resolves every op of `ember.kernel_ops.KERNEL_OPS` to one callable at build time: the
plugins' impls in their order, then the plain-torch reference here. Model code (and the attention backend, for
`write_kv`) calls `ops.rms_norm(...)` etc. on the table it was built with; nothing reaches a kernel through a module
global. `KernelOps.reference()` is the torch-only table (what a machine without any kernel plugin runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ember.kernel_ops import KERNEL_OPS, KernelOpImpl, Linear, RmsNorm, Rotary, SiluAndMul, WriteKV
from ember_platform.engine.attention import write_kv as torch_write_kv

if TYPE_CHECKING:
    from ember.plugins import PluginHost

REFERENCE = "torch"  # how the reference appears in `KernelOps.selections`


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of h = x + residual in float32, times the weight after casting back (as transformers does)."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the half-split (GPT-NeoX) convention Llama checkpoints use (a new tensor)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def torch_write_kv_op(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                      slot_mapping: torch.Tensor, scratch: dict[str, Any] | None = None) -> bool:
    torch_write_kv(kv_cache, k, v, slot_mapping, scratch)
    return True


REFERENCES: dict[str, Callable[..., Any]] = {
    "rms_norm": torch_rms_norm,
    "silu_and_mul": torch_silu_and_mul,
    "rotary": torch_rotary,
    "write_kv": torch_write_kv_op,
    "linear": F.linear,
}
assert REFERENCES.keys() == KERNEL_OPS.keys(), "every kernel op needs a torch reference"


def _declined(out: Any) -> bool:
    return out is None or out is NotImplemented or out is False


def chain(impls: Sequence[Callable[..., Any]], reference: Callable[..., Any]) -> Callable[..., Any]:
    """One callable trying `impls` in order, then `reference`: composed once, so a call costs one frame per impl."""
    if not impls:
        return reference
    if len(impls) == 1:
        (only,) = impls

        def first_or_reference(*args: Any) -> Any:
            out = only(*args)
            return reference(*args) if out is None or out is NotImplemented or out is False else out
        return first_or_reference

    def in_order(*args: Any) -> Any:
        for impl in impls:
            out = impl(*args)
            if not _declined(out):
                return out
        return reference(*args)
    return in_order


@dataclass(frozen=True, slots=True)
class KernelOps:
    """The resolved table: one callable per op (signatures in `ember.kernel_ops`), and who provides each."""

    rms_norm: RmsNorm
    silu_and_mul: SiluAndMul
    rotary: Rotary
    write_kv: WriteKV
    linear: Linear
    # Per op, what is tried in order: "plugin:op" for each available plugin impl, then "torch".
    selections: dict[str, list[str]] = field(default_factory=dict, compare=False)

    @classmethod
    def reference(cls) -> KernelOps:
        """Plain torch for every op."""
        return cls(**REFERENCES, selections={op: [REFERENCE] for op in KERNEL_OPS})  # type: ignore[arg-type]

    @classmethod
    def from_impls(cls, impls: dict[str, Sequence[KernelOpImpl]]) -> KernelOps:
        """The table for these impls per op (each list first tried first); unavailable ones (None) are skipped."""
        ops: dict[str, Any] = {}
        selections: dict[str, list[str]] = {}
        for op, reference in REFERENCES.items():
            loaded = [(impl, fn) for impl in impls.get(op, ()) if (fn := impl.load()) is not None]
            ops[op] = chain([fn for _, fn in loaded], reference)
            selections[op] = [f"{impl.plugin}:{op}" for impl, _ in loaded] + [REFERENCE]
        return cls(**ops, selections=selections)

    @classmethod
    def from_plugins(cls, host: PluginHost) -> KernelOps:
        """The table for the plugins `host` holds (its `ember_kernel_ops` registrations)."""
        registry = host.kernel_ops
        return cls.from_impls({op: registry.for_op(op) for op in KERNEL_OPS})

    def describe(self) -> dict[str, str]:
        """Per op, its impls in the order tried, e.g. {"rms_norm": "kernels-cpu:rms_norm > torch"}."""
        return {op: " > ".join(chosen) for op, chosen in self.selections.items()}
