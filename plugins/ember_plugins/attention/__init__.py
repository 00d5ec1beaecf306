"""Built-in paged-attention backends, registered like any third-party plugin.

Entry point: `attention-torch = "ember_plugins.attention"`. Only names are registered here; the
backend module (and torch with it) is imported when an engine asks for the backend.
"""

from __future__ import annotations

from ember import hookimpl
from ember.hookspecs import Register


@hookimpl
def ember_attention_backends(register: Register) -> None:
    register("torch", "ember_plugins.attention.torch_paged:TorchPagedAttention",
             summary="portable PyTorch paged attention (CPU and CUDA): chunked online softmax over the block table; "
                     "KV cache in the model dtype, int8 or fp8",
             options=("max_batched_query_len", "chunk_elements", "native"))
