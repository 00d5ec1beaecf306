"""The Ember platform: engine, replica runtime, gateway, control plane, routing and KV tiers.

Needs the `serve` extra (torch and friends). The public engine API:

    from ember_platform import LLM, SamplingParams
    llm = LLM("examples/tiny-llama")            # an Ember package or a Hugging Face checkpoint dir
    out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember_platform.engine.async_engine import AsyncEngine
    from ember_platform.engine.llm import LLM
    from ember_platform.engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy: importing ember_platform (e.g. for the gateway) must not import torch.
    if name == "LLM":
        from ember_platform.engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from ember_platform.engine.async_engine import AsyncEngine
        return AsyncEngine
    if name == "SamplingParams":
        from ember_platform.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
