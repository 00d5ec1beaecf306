"""A worker: one rank of a replica. It owns the model (built for its `ParallelContext`), its KV cache, the
LoRA slots and the runner, and executes the core's step plans. Executors create one per rank."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ember_platform.engine.attention import KVCache, KVCacheSpec, check_backend_settings
from ember_platform.engine.host_memory import release_pages
from ember_platform.engine.lora_layer import lora_layouts
from ember_platform.engine.lora_manager import LoRAManager
from ember_platform.engine.model_runner import ModelRunner, allocate_kv_caches, kv_bytes_per_block
from ember_platform.engine.models import build_model
from ember_platform.engine.parallel import ParallelContext
from ember_platform.engine.quantized_load import load_quantized
from ember_platform.engine.speculation import DraftKVSpec
from ember_platform.engine.step_plan import StepOutput, StepPlan

if TYPE_CHECKING:
    from collections.abc import Hashable

    from ember.hardware import Hardware
    from ember.manifest import Manifest
    from ember.plugins import PluginHost
    from ember.selection import SelectionReport
    from ember_platform.engine.config import ModelSource

log = logging.getLogger("ember.engine")

CPU_KV_CACHE_DEFAULT_GB = 4.0  # like vLLM's CPU backend: a fixed budget, since host RAM is shared


@dataclass(slots=True)
class WorkerConfig:
    """What every rank needs to build its part of the replica (the same for all ranks)."""

    source: ModelSource
    hf_config: dict[str, Any]
    dtype: torch.dtype
    block_size: int
    attention: Any  # the attention backend factory (the selected technique)
    kernel_ops: Any  # the kernel-op table (`KernelOps`) every layer calls
    quantization: SelectionReport
    manifest: Manifest
    hardware: Hardware
    plugins: PluginHost
    lora_options: dict[str, Any] = field(default_factory=dict)
    attention_options: dict[str, Any] = field(default_factory=dict)  # the selection's `[kernels] options`


@dataclass(frozen=True, slots=True)
class LoadReport:
    """How a rank's load went: seconds per phase ("load", "quantize"), and whether quantized weights came from
    the cache of an earlier start."""

    timings: dict[str, float]
    quantized_from_cache: bool = False
    quantization_states: dict[str, Any] = field(default_factory=dict)  # technique -> `Quantizer.state()`


@dataclass(frozen=True, slots=True)
class RankKVCacheSpec:
    """One rank's paged KV cache: each layer's `KVCacheSpec`, as its attention backend declared it."""

    layers: tuple[KVCacheSpec, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs over all layers, in the stored dtype with its scales."""
        return sum(layer.bytes_per_block for layer in self.layers)


def kv_cache_shape(hf_config: dict[str, Any]) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a Llama-family or Mixtral config."""
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    return int(hf_config["num_hidden_layers"]), int(hf_config.get("num_key_value_heads") or heads), head_dim


class Worker:
    """One rank: `load_model()`, then `init_kv_cache(n)`, then `execute(plan)` per step."""

    def __init__(self, config: WorkerConfig, parallel: ParallelContext) -> None:
        self.config = config
        self.parallel = parallel
        self.device = parallel.device
        self.model: nn.Module | None = None
        self.lora: LoRAManager | None = None
        self.runner: ModelRunner | None = None
        self.timings: dict[str, float] = {}
        self.quantized_from_cache = False
        self.quantization_states: dict[str, Any] = {}
        self._num_blocks = 0
        self._draft_spec: DraftKVSpec | None = None
        self.kv_caches: list[KVCache] = []
        self.draft_kv_caches: list[KVCache] = []

    # --- model ------------------------------------------------------------------------------

    def _build(self) -> nn.Module:
        c = self.config
        return build_model(c.hf_config, self._attention_factory(), c.dtype, self.device, ops=c.kernel_ops,
                           parallel=self.parallel)

    def _attention_factory(self) -> Any:
        """The selected backend with the engine's part of its arguments bound: `[runtime] kv_cache_dtype` (refused
        here, before any weight loads, unless the backend declares it) and the selection's `[kernels] options`
        (only keys the plugin declared get this far); the model adds each layer's spec and the kernel ops."""
        c = self.config
        kv_cache_dtype = c.manifest.runtime.kv_cache_dtype
        check_backend_settings(c.attention, kv_cache_dtype, c.block_size)
        return functools.partial(c.attention, kv_cache_dtype=kv_cache_dtype, **c.attention_options)

    def load_model(self) -> LoadReport:
        """Build the model on meta for this rank, load (and quantize, or restore cached quantized) weights."""
        c = self.config
        model = self._build()
        # Read before quantizing: a quantizer's modules need not say how their outputs are packed.
        layouts = lora_layouts(model, getattr(model, "lora_module_names", ()))
        checkpoint_target = model.checkpoint_target
        # Every layer's LinearMethod from the quantization chain (or the checkpoint's own quantization_config),
        # then the checkpoint streamed through them, or the quantized weights an earlier start cached.
        model, quantized = load_quantized(model, self._build, source=c.source, hf_config=c.hf_config,
                                          selection=c.quantization, plugins=c.plugins, dtype=c.dtype,
                                          device=self.device)
        self.timings.update(quantized.timings)
        self.quantized_from_cache = quantized.from_cache
        self.quantization_states = quantized.states
        model.eval()
        self.model = model
        c.plugins.model_loaded(c.manifest, model, c.hardware)

        def lora_target(peft_module: str) -> tuple[str, Hashable | None] | None:
            """A PEFT module path (transformers' naming) -> (our LoRA layer, shard id): the checkpoint mapping."""
            target = checkpoint_target(f"{peft_module}.weight")
            if target is None or not target[0].endswith(".weight"):
                return None
            return target[0].removesuffix(".weight"), target[1]

        options = c.lora_options
        budget = options.get("lora_memory_gb")
        self.lora = LoRAManager(model, layouts, lora_target, max_loras=options.get("max_loras", 4),
                                max_lora_rank=options.get("max_lora_rank", 64),
                                max_cpu_loras=options.get("max_cpu_loras"),
                                memory_budget_bytes=None if budget is None else budget * 2**30,
                                device=self.device, dtype=c.dtype, refusal=quantized.lora_refusal)
        return LoadReport(dict(self.timings), self.quantized_from_cache, dict(self.quantization_states))

    # --- KV cache ---------------------------------------------------------------------------

    def kv_cache_spec(self) -> RankKVCacheSpec:
        """This rank's cache, from each layer's attention backend (its layout, stored dtype and scales). (A
        tensor-parallel strategy holds num_kv_heads / world of the heads; the model families do not split heads
        yet, so every rank holds all of them.)"""
        assert self.model is not None, "load_model() first"
        block_size = self.config.block_size
        for backend in self.model.attention_backends:
            if not callable(getattr(backend, "kv_cache_spec", None)):
                raise TypeError(f"attention backend {type(backend).__name__} has no kv_cache_spec(block_size): an "
                                "AttentionBackend (ember_platform.api) declares the KV cache layout it reads")
        return RankKVCacheSpec(tuple(b.kv_cache_spec(block_size) for b in self.model.attention_backends))

    def kv_bytes_per_block(self, draft: DraftKVSpec | None = None) -> int:
        """Bytes one KV block costs on this rank, a speculator's draft cache included."""
        per_block = self.kv_cache_spec().bytes_per_block
        if draft is not None:
            per_block += kv_bytes_per_block(draft.num_layers, self.config.block_size, draft.num_kv_heads,
                                            draft.head_dim, draft.dtype or self.config.dtype)
        return per_block

    def available_kv_memory(self) -> int:
        """The bytes this rank may give its KV cache: `[runtime] kv_cache_memory_gb`, else on a GPU the free
        memory times `memory_utilization` (measured now, after the weights loaded), else a fixed CPU budget."""
        rt = self.config.manifest.runtime
        if rt.kv_cache_memory_gb is not None:
            return int(rt.kv_cache_memory_gb * 2**30)
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free * rt.memory_utilization)
        return int(min(CPU_KV_CACHE_DEFAULT_GB * 2**30, self.config.hardware.host_memory_bytes * 0.25))

    def init_kv_cache(self, num_blocks: int, draft: DraftKVSpec | None = None) -> None:
        """Allocate `num_blocks` blocks (and a draft cache of as many, if a speculator declared one)."""
        assert self.model is not None, "load_model() first"
        self._num_blocks, self._draft_spec = num_blocks, draft
        self._allocate()
        self.runner = ModelRunner(self.model, self.kv_caches, self.config.block_size, self.device, lora=self.lora)

    def _allocate(self) -> None:
        s = self.kv_cache_spec()
        self.kv_caches = [layer.allocate(self._num_blocks, self.device) for layer in s.layers]
        d = self._draft_spec
        self.draft_kv_caches = [] if d is None else allocate_kv_caches(
            d.num_layers, self._num_blocks + d.scratch_blocks, self.config.block_size, d.num_kv_heads, d.head_dim,
            d.dtype or self.config.dtype, self.device)
        if self.runner is not None:
            self.runner.kv_caches = self.kv_caches

    # --- steps ------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutput:
        assert self.runner is not None, "init_kv_cache() first"
        return self.runner.execute(plan)

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy the KV cache's slots `src` to `dst` (spec_tree.py: an accepted tree path made consecutive)."""
        assert self.runner is not None, "init_kv_cache() first"
        self.runner.move_kv(src, dst)

    # --- sleep ------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Give the KV cache's memory back: on Linux CPUs in place (pages read as zeros when next touched), else
        by freeing it (`wake` reallocates)."""
        caches = [t for kv in (*self.kv_caches, *self.draft_kv_caches) for t in kv]
        if self.device.type == "cpu" and release_pages(caches):
            return
        self.kv_caches, self.draft_kv_caches = [], []
        if self.runner is not None:
            self.runner.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if not self.kv_caches:  # freed, not released in place
            self._allocate()
