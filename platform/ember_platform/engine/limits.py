"""Settings the engine refuses at load rather than honour badly: a context longer than the model's, a KV cache that
cannot hold one sequence of that context. Both were accepted before, and every long request then came back empty
(finish_reason "length") or produced what the model was never trained to."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ember.manifest import MANIFEST_NAME
from ember_platform.engine.config import ModelSource

# Rope scalings that stretch the trained context by their `factor` (the config's max_position_embeddings is the
# original one); llama3 configs state the stretched context themselves.
_STRETCHING_ROPE = frozenset({"linear", "dynamic", "yarn", "longrope"})


def where(source: ModelSource) -> str:
    """The file a user edits to change the engine's settings."""
    return str(source.root / MANIFEST_NAME) if source.is_package else str(source.root / "config.json")


def model_context(hf_config: Mapping[str, Any]) -> int | None:
    """The longest context the checkpoint was made for, rope scaling included; None where the config does not say."""
    trained = hf_config.get("max_position_embeddings")
    if not trained:
        return None
    scaling = hf_config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in _STRETCHING_ROPE and scaling.get("factor") and not scaling.get("original_max_position_embeddings"):
        return int(int(trained) * float(scaling["factor"]))
    return int(trained)


def check_context_length(max_model_len: int | None, hf_config: Mapping[str, Any], source: ModelSource) -> None:
    """ValueError when `[runtime] max_model_len` asks for more context than the model has."""
    limit = model_context(hf_config)
    if max_model_len and limit and max_model_len > limit:
        raise ValueError(f"{where(source)}: runtime.max_model_len = {max_model_len} is longer than the model's context "
                         f"({limit} tokens: max_position_embeddings in config.json, with its rope scaling): positions "
                         f"past it were never trained. Set max_model_len <= {limit}, or leave it unset.")


def check_kv_capacity(num_blocks: int, block_size: int, max_model_len: int, source: ModelSource) -> None:
    """ValueError when the KV cache cannot hold one sequence of `max_model_len` tokens (vLLM refuses the same)."""
    if num_blocks * block_size < max_model_len:
        raise ValueError(f"{where(source)}: the KV cache holds {num_blocks * block_size} tokens ({num_blocks} "
                         f"blocks of {block_size}), less than one sequence of runtime.max_model_len = {max_model_len}: "
                         "raise runtime.kv_cache_memory_gb (or memory_utilization on a GPU), or lower max_model_len.")
