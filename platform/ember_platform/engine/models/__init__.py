"""Model code for Hugging Face checkpoints: the architecture registry, `build_model` and `load_model`.

    model = build_model(checkpoint_dir, TorchPagedAttention, torch.bfloat16, "cuda", ops=ops)  # on meta
    load_weights(model, checkpoint_dir)                                              # mmap + copy
    hidden = model(input_ids, positions, meta, kv_caches)                            # [T, D]
    logits = model.compute_logits(hidden[last_token_rows])                           # [N, V] float32
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ember_platform.engine.attention import AttentionBackendFactory
from ember_platform.engine.kernel_ops import KernelOps
from ember_platform.engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from ember_platform.engine.models.loader import LoadedWeights, load_weights
from ember_platform.engine.models.mixtral import MixtralForCausalLM
from ember_platform.engine.parallel import ParallelContext

CausalLM = LlamaForCausalLM  # the interface every model class implements (they all derive from it today)

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

__all__ = ["ARCHITECTURES", "CausalLM", "LoadedWeights", "build_model", "load_model", "load_weights",
           "model_class", "read_config"]


def read_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """A Hugging Face config as a dict: given as one, or as a checkpoint dir / config.json path."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no model config at {path} (a Hugging Face checkpoint has a config.json)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None


def model_class(config: Mapping[str, Any]) -> type[CausalLM]:
    """The model class for the config's `architectures`; a ValueError names unsupported ones."""
    architectures = config.get("architectures") or []
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    given = ", ".join(architectures) if architectures else "none (config.json has no 'architectures')"
    raise ValueError(f"unsupported model architecture: {given}; supported: {', '.join(sorted(ARCHITECTURES))}")


def config_dtype(config: Mapping[str, Any]) -> torch.dtype:
    """The checkpoint's own dtype (`dtype`, or `torch_dtype` in older configs); float32 if unstated."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config dtype '{name}' is not a torch dtype")
    return dtype


def build_model(config: Mapping[str, Any] | str | Path, attn_backend: AttentionBackendFactory,
                dtype: torch.dtype | None = None, device: torch.device | str = "cpu", *,
                ops: KernelOps | None = None, parallel: ParallelContext | None = None) -> CausalLM:
    """Construct the model for `config` on the meta device (no memory); `load_weights` fills it.

    `attn_backend` is an attention backend class (or factory), called once per distinct attention
    configuration as `attn_backend(layer=AttentionLayerSpec, ops=ops)`; `model.attention_backends` lists the
    backend of each layer. `dtype` defaults to the config's.
    `ops` is the kernel-op table every layer calls (an engine's is `KernelOps.from_plugins(its plugins)`);
    None: `KernelOps.reference()`, plain torch.
    `parallel` is the rank the model is built for (stored as `model.parallel`; None: one device, no groups).
    """
    cfg = read_config(config)
    cls = model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg, attn_backend, dtype=dtype or config_dtype(cfg), device=device,
                    ops=ops if ops is not None else KernelOps.reference())
    model.parallel = parallel if parallel is not None else ParallelContext.single(device)
    return model.eval()


def load_model(checkpoint_dir: str | Path, attn_backend: AttentionBackendFactory, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", *, ops: KernelOps | None = None) -> CausalLM:
    """`build_model` + `load_weights` for a Hugging Face checkpoint directory."""
    model = build_model(checkpoint_dir, attn_backend, dtype, device, ops=ops)
    load_weights(model, checkpoint_dir)
    return model
