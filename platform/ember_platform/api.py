"""The platform's public API for plugins: the one module a plugin imports from `ember_platform`.

Everything else in `ember_platform` may change without notice; these names are the contracts technique plugins
implement or call (Ember's built-in plugins import nothing else, tests/test_import_boundaries.py checks it).

Names load on first use (PEP 562): the gateway loads routing-scorer plugins and must stay torch-free, so importing
this module imports nothing, and `from ember_platform.api import Score` imports only the routing module. To add a
contract, add one line to `_EXPORTS` (name -> defining module) and the same name to the TYPE_CHECKING imports.
"""

# ruff: noqa: F401  (the TYPE_CHECKING imports are re-exports, for type checkers)

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # attention backends (ember_attention_backends)
    "AttentionBackend": "ember_platform.engine.attention",
    "AttentionLayerSpec": "ember_platform.engine.attention",
    "AttentionMetadata": "ember_platform.engine.attention",
    "AttentionMetadataBuilder": "ember_platform.engine.attention",
    "KVCache": "ember_platform.engine.attention",
    "KVCacheSpec": "ember_platform.engine.attention",
    "hnd_kv_cache_spec": "ember_platform.engine.attention",
    "kv_cache_block_shape": "ember_platform.engine.attention",
    "write_kv": "ember_platform.engine.attention",  # the torch reference; backends call ops.write_kv
    # kernel ops (ember_kernel_ops): the table a model and its attention backends are built with
    "KernelOps": "ember_platform.engine.kernel_ops",
    # quantizers (ember_quantizers): a technique picks each layer's LinearMethod
    "Quantizer": "ember_platform.engine.quantization",
    "QuantizationContext": "ember_platform.engine.quantization",
    "QuantizationError": "ember_platform.engine.quantization",
    "skipped": "ember_platform.engine.quantization",
    "Linear": "ember_platform.engine.linear_method",
    "LinearMethod": "ember_platform.engine.linear_method",
    "LinearSpec": "ember_platform.engine.linear_method",
    "UNQUANTIZED": "ember_platform.engine.linear_method",
    "UnquantizedLinearMethod": "ember_platform.engine.linear_method",
    "copy_shard": "ember_platform.engine.linear_method",
    "linear_modules": "ember_platform.engine.linear_method",
    "CalibrationContext": "ember_platform.engine.calibration",
    "ModelStructure": "ember_platform.engine.models.structure",
    "NormFeed": "ember_platform.engine.models.structure",
    "AttentionBlock": "ember_platform.engine.models.structure",
    # speculators (ember_speculators)
    "Proposal": "ember_platform.engine.speculation",
    "Request": "ember_platform.engine.request",
    "Speculator": "ember_platform.engine.speculation",
    "SpeculatorContext": "ember_platform.engine.speculation",
    "SpeculatorInputs": "ember_platform.engine.speculation",
    "DraftKVSpec": "ember_platform.engine.speculation",
    # model code (a draft model run by a speculator): build on meta with an attention backend, then load
    "build_model": "ember_platform.engine.models",
    "load_weights": "ember_platform.engine.models",
    # parallel strategies (ember_parallel_strategies): an Executor runs one Worker per rank
    "Executor": "ember_platform.engine.executor",
    "ParallelContext": "ember_platform.engine.parallel",
    "StepOutput": "ember_platform.engine.step_plan",
    "StepPlan": "ember_platform.engine.step_plan",
    "Worker": "ember_platform.engine.worker",
    "WorkerConfig": "ember_platform.engine.worker",
    # routing scorers (ember_routing_scorers); torch-free
    "KV_TIERS": "ember_platform.routing",
    "ReplicaView": "ember_platform.routing",
    "RouteRequest": "ember_platform.routing.scoring",
    "Score": "ember_platform.routing.scoring",
    # tool-call parsers (ember_tool_parsers); torch-free
    "CallSegment": "ember_platform.tools.parser",
    "Segment": "ember_platform.tools.parser",
    "TextSegment": "ember_platform.tools.parser",
    "ToolParser": "ember_platform.tools.parser",
    "partial_marker": "ember_platform.tools.parser",
    "Tool": "ember_platform.tools.calls",
    "ToolCall": "ember_platform.tools.calls",
    "JsonCall": "ember_platform.tools.json_call",
    "scan_json_call": "ember_platform.tools.json_call",
    "MAX_PARALLEL_CALLS": "ember_platform.tools.grammar",
    "call_schema": "ember_platform.tools.grammar",
    "json_rule": "ember_platform.tools.grammar",
    "lark_string": "ember_platform.tools.grammar",
    "repeated": "ember_platform.tools.grammar",
    "text_up_to": "ember_platform.tools.grammar",
    "text_without": "ember_platform.tools.grammar",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from ember_platform.engine.attention import (
        AttentionBackend,
        AttentionLayerSpec,
        AttentionMetadata,
        AttentionMetadataBuilder,
        KVCache,
        KVCacheSpec,
        hnd_kv_cache_spec,
        kv_cache_block_shape,
        write_kv,
    )
    from ember_platform.engine.calibration import CalibrationContext
    from ember_platform.engine.executor import Executor
    from ember_platform.engine.kernel_ops import KernelOps
    from ember_platform.engine.linear_method import (
        UNQUANTIZED,
        Linear,
        LinearMethod,
        LinearSpec,
        UnquantizedLinearMethod,
        copy_shard,
        linear_modules,
    )
    from ember_platform.engine.models import build_model, load_weights
    from ember_platform.engine.models.structure import AttentionBlock, ModelStructure, NormFeed
    from ember_platform.engine.parallel import ParallelContext
    from ember_platform.engine.quantization import QuantizationContext, QuantizationError, Quantizer, skipped
    from ember_platform.engine.request import Request
    from ember_platform.engine.speculation import DraftKVSpec, Proposal, Speculator, SpeculatorContext, SpeculatorInputs
    from ember_platform.engine.step_plan import StepOutput, StepPlan
    from ember_platform.engine.worker import Worker, WorkerConfig
    from ember_platform.routing import KV_TIERS, ReplicaView
    from ember_platform.routing.scoring import RouteRequest, Score
    from ember_platform.tools.calls import Tool, ToolCall
    from ember_platform.tools.grammar import (
        MAX_PARALLEL_CALLS,
        call_schema,
        json_rule,
        lark_string,
        repeated,
        text_up_to,
        text_without,
    )
    from ember_platform.tools.json_call import JsonCall, scan_json_call
    from ember_platform.tools.parser import CallSegment, Segment, TextSegment, ToolParser, partial_marker


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ember_platform.api' has no attribute '{name}' "
                             f"(the platform's plugin API: {', '.join(__all__)})")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
