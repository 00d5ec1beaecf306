"""Hardware-aware rules for manifests that say "auto".

Each rule answers only when the manifest leaves the choice to plugins and the technique it
prefers is installed; otherwise it passes (returns None) and the next plugin, or Ember's
plain fallback, decides.
"""

from __future__ import annotations

from ember import Hardware, Manifest, Selection, hookimpl

AUTO = "auto"


@hookimpl
def ember_select_quantization(manifest: Manifest, hardware: Hardware,
                              available: frozenset[str]) -> Selection | None:
    if manifest.quantization.method != AUTO:
        return None
    if hardware.is_cuda and hardware.has_compute_capability(8, 9) and "fp8" in available:
        # W8A8: the tensor cores multiply fp8 by fp8, so activations are quantized too (per token).
        return Selection("fp8", {"activations": "fp8"},
                         reason=f"auto: {hardware.device_name} has FP8 tensor cores (sm_89+): W8A8 fp8")
    if not hardware.is_cuda and "int8" in available:
        # Batch-1 decode on a CPU is bound by reading weights: int8 halves the bytes of bf16.
        return Selection("int8", reason="auto: on a CPU, weight-only int8 halves the weight bytes decode reads")
    return None


@hookimpl
def ember_select_attention_backend(manifest: Manifest, hardware: Hardware,
                                   available: frozenset[str]) -> Selection | None:
    if manifest.kernels.attention != AUTO:
        return None
    if hardware.is_cuda:
        if "flashinfer" in available and hardware.has_compute_capability(8, 0):
            return Selection("flashinfer", reason=f"auto: FlashInfer paged kernels on {hardware.device_name}")
        if "triton" in available:
            return Selection("triton", reason="auto: Triton paged attention on CUDA")
    if "torch" in available:
        return Selection("torch", reason=f"auto: portable PyTorch paged attention on {hardware.device_kind}")
    return None
