"""Which LoRA adapters are resident, S-LoRA style: registered adapters live on disk, recently used ones
in host memory, and up to `max_loras` of them in device slots (the stacks `LoRALinear` layers read).

An adapter is loaded into a slot when the scheduler admits a request for it; when every slot is taken, the
least recently used adapter that no running request uses is evicted. Running requests pin their adapter,
so a batch never loses one mid-flight. Loading time is measured per adapter: the router prices a replica
that would have to load an adapter by it. Listeners hear the resident set whenever it changes.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ember_platform.engine.lora import LoRAAdapterError, LoRAAdapterSpec, LoRAWeights, inspect_adapter, load_adapter
from ember_platform.engine.lora_layer import LoRAContext, LoRALayout, LoRALinear, LoRAStep
from ember_platform.engine.scheduler import LoRALoadError

log = logging.getLogger("ember.engine.lora")

LoRAListener = Callable[[frozenset[str]], None]


class UnknownLoRAError(ValueError):
    """A request named an adapter this engine does not have."""

    def __init__(self, name: str, available: Sequence[str]) -> None:
        self.name, self.available = name, list(available)
        have = (f"available: {', '.join(self.available)}" if self.available else
                "this model has no LoRA adapters (add [[lora]] entries to ember.toml, or call add_lora)")
        super().__init__(f"unknown LoRA adapter '{name}'; {have}")


class LoRAManager:
    """Registered adapters, the device slots and their LRU order, and the per-step slot index."""

    def __init__(self, model: nn.Module, layouts: Mapping[str, LoRALayout],
                 target_of: Callable[[str], tuple[str, Hashable | None] | None], *, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int | None = None, memory_budget_bytes: float | None = None,
                 device: torch.device, dtype: torch.dtype, refusal: str | None = None) -> None:
        if max_loras < 0 or max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1 (got {max_loras}, {max_lora_rank})")
        self.model = model
        self.refusal = refusal  # why no adapter can apply to this model's weights (a quantizer's), or None
        self.layouts = dict(layouts)
        self.target_of = target_of
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras if max_cpu_loras is not None else 2 * max_loras, 1)
        self.memory_budget_bytes = memory_budget_bytes
        self.device, self.dtype = device, dtype
        self.context = LoRAContext()
        self.specs: dict[str, LoRAAdapterSpec] = {}
        self._retired: dict[str, str] = {}  # removed name -> digest: a name may come back only unchanged
        self._host: OrderedDict[str, LoRAWeights] = OrderedDict()  # least recently used first
        self._slots: list[str | None] = [None] * max_loras
        self._slot_of: dict[str, int] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident adapters, least recently used first
        self._layers: dict[str, LoRALinear] = {}  # wrapped on the first load
        self._rank = 0  # the stacks' padded rank: the largest rank loaded so far
        self._listeners: list[LoRAListener] = []
        self.load_seconds: dict[str, float] = {}  # last measured disk/host -> device load, per adapter
        self.num_loads = 0
        self.num_evictions = 0

    # --- registry ---------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> LoRAAdapterSpec:
        if name in self.specs:
            raise ValueError(f"a LoRA adapter named '{name}' is already registered; remove_lora('{name}') first")
        if self.max_loras == 0:
            raise ValueError("this engine was started with max_loras=0: it serves no LoRA adapters")
        if self.refusal is not None:
            raise LoRAAdapterError(f"LoRA adapter '{name}': not supported with {self.refusal}")
        spec = inspect_adapter(name, path, self.layouts, self.target_of, max_rank=self.max_lora_rank)
        retired = self._retired.get(name)
        if retired is not None and retired != spec.digest:
            # Cached KV blocks (here, in the KV tiers, and the router's view of them) are keyed by the name.
            raise LoRAAdapterError(f"LoRA adapter '{name}' was served before with different weights; KV blocks "
                                   "cached for it are keyed by its name, so give the new weights a new name "
                                   f"(e.g. '{name}-v2')")
        needed = self.stack_bytes(max(self._rank, spec.rank))
        if self.memory_budget_bytes is not None and needed > self.memory_budget_bytes:
            raise LoRAAdapterError(f"LoRA adapter '{name}' (rank {spec.rank}): {self.max_loras} slots at that rank "
                                   f"need {needed / 2**20:.1f} MiB, over the LoRA memory budget of "
                                   f"{self.memory_budget_bytes / 2**20:.1f} MiB; lower max_loras or raise the budget")
        self.specs[name] = spec
        self._retired.pop(name, None)
        log.info("LoRA adapter '%s' registered from %s (rank %d, %d modules)", name, spec.path, spec.rank,
                 len(spec.targets))
        return spec

    def unregister(self, name: str) -> None:
        spec = self.specs.pop(name)
        self._retired[name] = spec.digest
        self._host.pop(name, None)
        if name in self._slot_of:
            self._free(name)
            self._notify()

    @property
    def names(self) -> list[str]:
        return sorted(self.specs)

    @property
    def resident(self) -> frozenset[str]:
        return frozenset(self._slot_of)

    def add_listener(self, listener: LoRAListener) -> None:
        """`listener(resident_names)` is called (on the engine's thread) each time the resident set changes."""
        self._listeners.append(listener)

    def estimated_load_seconds(self, name: str) -> float | None:
        """What loading `name` into a slot costs: its last measured load, else the mean over adapters loaded."""
        if name in self.load_seconds:
            return self.load_seconds[name]
        return sum(self.load_seconds.values()) / len(self.load_seconds) if self.load_seconds else None

    def stack_bytes(self, rank: int | None = None) -> int:
        """Device memory of every slot's stacks at `rank` (default: the current padded rank)."""
        rank = self._rank if rank is None else rank
        per_rank = sum(len(lay.slices) * lay.in_features + lay.out_features for lay in self.layouts.values())
        return self.max_loras * rank * per_rank * torch.empty((), dtype=self.dtype).element_size()

    # --- scheduling ---------------------------------------------------------------------------

    def acquire(self, name: str, in_use: Iterable[str]) -> bool:
        """Make `name` resident for a request being admitted: True if it is (now), False if every slot holds an
        adapter that running requests use. May evict the least recently used idle adapter and load `name`."""
        if name in self._slot_of:
            self._lru.move_to_end(name)
            return True
        slot = self._free_slot()
        victim = None
        if slot is None:
            busy = set(in_use)
            victim = next((n for n in self._lru if n not in busy), None)
            if victim is None:
                return False
            slot = self._free(victim)
            self.num_evictions += 1
            log.info("LoRA adapter '%s' evicted for '%s'", victim, name)
        try:
            self._load(name, slot)
        finally:
            if victim is not None or name in self._slot_of:  # the victim is gone even if the load failed
                self._notify()
        return True

    def begin_step(self, lora_names: Sequence[str | None], num_tokens: Sequence[int]) -> None:
        """Build the step's token -> slot index (once; every LoRA layer reads it) and mark adapters used.

        One entry per request of the step: its adapter's name (None: the base model) and its number of tokens."""
        slots = []
        for name in lora_names:
            if name is None:
                slots.append(-1)
                continue
            slot = self._slot_of.get(name)
            if slot is None:  # the scheduler acquires before admitting, and running requests pin theirs
                raise RuntimeError(f"a request runs with LoRA adapter '{name}', which is not resident")
            self._lru.move_to_end(name)
            slots.append(slot)
        top = max(slots, default=-1)
        if top < 0:
            self.context.step = None  # no adapter in this step: the layers skip the LoRA path entirely
            return
        token_slots = torch.tensor(slots).repeat_interleave(torch.tensor(list(num_tokens)))
        self.context.step = LoRAStep(token_slots.to(self.device, non_blocking=True), top + 1, self.dtype)

    def end_step(self) -> None:
        self.context.step = None

    # --- slots --------------------------------------------------------------------------------

    def _free_slot(self) -> int | None:
        # The lowest free slot: steps compute over slots [0, highest used], so keep them packed.
        return next((i for i, n in enumerate(self._slots) if n is None), None)

    def _free(self, name: str) -> int:
        slot = self._slot_of.pop(name)
        self._slots[slot] = None
        self._lru.pop(name, None)
        return slot  # its stale weights stay, unread: no token maps to a free slot

    def _load(self, name: str, slot: int) -> None:
        t0 = time.perf_counter()
        spec = self.specs[name]
        try:
            weights = self._host_weights(spec)
        except Exception as e:  # whatever reading the files raised (safetensors has its own error type)
            raise LoRALoadError(f"LoRA adapter '{name}' could not be read from {spec.path}: {e}") from e
        self._wrap()
        if spec.rank > self._rank:
            self._grow(spec.rank)
        for module, layer in self._layers.items():
            assert layer.lora_a is not None
            layer.lora_a[slot].zero_()
            for b in layer.lora_b:
                b[slot].zero_()
            for j, pair in enumerate(weights.get(module, ())):
                if pair is not None:
                    a, b_t = pair
                    layer.lora_a[slot, j, :a.shape[0]].copy_(a, non_blocking=True)
                    layer.lora_b[j][slot, :b_t.shape[0]].copy_(b_t, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the measured cost must include the copies
        self._slots[slot] = name
        self._slot_of[name] = slot
        self._lru[name] = None
        self.num_loads += 1
        self.load_seconds[name] = time.perf_counter() - t0
        log.info("LoRA adapter '%s' loaded into slot %d in %.1f ms", name, slot, 1e3 * self.load_seconds[name])

    def _host_weights(self, spec: LoRAAdapterSpec) -> LoRAWeights:
        weights = self._host.get(spec.name)
        if weights is None:
            weights = load_adapter(spec, self.layouts, self.dtype, pin_memory=self.device.type == "cuda")
            self._host[spec.name] = weights
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(spec.name)
        return weights

    def _wrap(self) -> None:
        """Put a LoRALinear around each LoRA-capable layer, whatever module (a quantizer's, say) is there now.
        Done on the first load, so that an engine that never serves an adapter runs the model untouched."""
        if self._layers:
            return
        for name, layout in self.layouts.items():
            parent_name, _, attr = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            layer = LoRALinear(getattr(parent, attr), layout, self.context)
            setattr(parent, attr, layer)
            self._layers[name] = layer

    def _grow(self, rank: int) -> None:
        """Re-pad every slot's stacks to `rank` (zeros beyond an adapter's own rank contribute nothing)."""
        old = self._rank
        for layer in self._layers.values():
            lay = layer.layout
            a = torch.zeros(self.max_loras, len(lay.slices), rank, lay.in_features, dtype=self.dtype,
                            device=self.device)
            bs = [torch.zeros(self.max_loras, rank, size, dtype=self.dtype, device=self.device)
                  for _, _, size in lay.slices]
            if layer.lora_a is not None:
                a[:, :, :old].copy_(layer.lora_a)
                for new, prev in zip(bs, layer.lora_b, strict=True):
                    new[:, :old].copy_(prev)
            layer.lora_a, layer.lora_b = a, bs
        self._rank = rank

    def _notify(self) -> None:
        resident = self.resident
        for listener in self._listeners:
            try:
                listener(resident)
            except Exception:  # a listener's bug must not take the engine's step loop down
                log.exception("LoRA listener %r failed", listener)
