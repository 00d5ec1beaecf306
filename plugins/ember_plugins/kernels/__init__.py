"""The native CPU kernels (`ember_kernels.cpu`) as kernel ops, registered like any third-party plugin.

Entry point: `kernels-cpu = "ember_plugins.kernels"`. Only names are registered here; `cpu.py` (and torch, and
the C build on first use) is imported when an engine builds its kernel-op table. Where the kernels are unavailable
(no C compiler, `EMBER_NATIVE_KERNELS=0`) each impl resolves to None and the engine runs the torch references.
Priority 0: a plugin registering an op with a higher priority is tried before these.
"""

from __future__ import annotations

from ember import hookimpl
from ember.kernel_ops import RegisterKernelOp

_SUMMARIES = {
    "rms_norm": "RMSNorm + residual add in one C call (float32, bfloat16; the torch formula's roundings)",
    "silu_and_mul": "SiLU-and-mul in one C call (float32, bfloat16)",
    "rotary": "rotary in place on strided q/k slices of the fused qkv output (float32, bfloat16)",
    "write_kv": "KV-cache slot copy from strided k/v slices (caches' dtype)",
    "linear": "float32 linear for 1-16 rows: weights streamed once for all rows, fixed summation order",
}


@hookimpl
def ember_kernel_ops(register: RegisterKernelOp) -> None:
    for op, summary in _SUMMARIES.items():
        register(op, f"ember_plugins.kernels.cpu:{op}", summary=f"native CPU: {summary}")
