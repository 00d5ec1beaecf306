"""Executors: what the engine core talks to. An executor runs one `Worker` per rank and returns the driver
(rank 0) worker's outputs; the core never touches a model or a device.

A parallel-strategy plugin (`ember_parallel_strategies`) registers an `Executor` subclass; the engine builds
the one of the strategy selected for the package ("none": `UniprocessExecutor`, one worker in this process).
A subclass implements `run_workers` (call a worker method on every rank, results in rank order); the rest
(loading, KV sizing, steps, sleep) is built on it. An executor whose rank-0 worker lives in this process
exposes it as `driver`: KV tiers and a speculator's draft KV cache read its tensors directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from ember_platform.engine.attention import KVCache
from ember_platform.engine.lora_manager import LoRAManager
from ember_platform.engine.parallel import ParallelContext, device_for
from ember_platform.engine.speculation import DraftKVSpec
from ember_platform.engine.step_plan import StepOutput, StepPlan
from ember_platform.engine.worker import LoadReport, Worker, WorkerConfig


class Executor(ABC):
    """Runs a replica's workers. Constructed as `cls(config, options)` with the strategy's selection options."""

    def __init__(self, config: WorkerConfig, options: Mapping[str, Any]) -> None:
        self.config = config
        self.options = dict(options)

    @property
    @abstractmethod
    def world_size(self) -> int:
        """How many ranks (workers) this executor runs."""

    @abstractmethod
    def run_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on every rank; the results in rank order."""

    @property
    def driver(self) -> Worker | None:
        """The rank-0 worker when it lives in this process, else None."""
        return None

    def parallel_context(self, rank: int, local_rank: int | None = None, **groups: Any) -> ParallelContext:
        """The context of `rank`, on the device the hardware probe found (cuda:local_rank, or the CPU)."""
        local = rank if local_rank is None else local_rank
        return ParallelContext(rank=rank, world_size=self.world_size, local_rank=local,
                               device=device_for(self.config.hardware.is_cuda, local), **groups)

    # --- built on run_workers -----------------------------------------------------------------

    def load_model(self) -> LoadReport:
        """Load every rank's model; rank 0's report."""
        return self.run_workers("load_model")[0]

    def available_kv_memory(self) -> int:
        """The KV budget of the tightest rank, in bytes."""
        return min(self.run_workers("available_kv_memory"))

    def kv_bytes_per_block(self, draft: DraftKVSpec | None = None) -> int:
        """The bytes one block costs on the rank where it costs most."""
        return max(self.run_workers("kv_bytes_per_block", draft))

    def init_kv_cache(self, num_blocks: int, draft: DraftKVSpec | None = None) -> None:
        self.run_workers("init_kv_cache", num_blocks, draft)

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step on every rank; the driver's output."""
        return self.run_workers("execute", plan)[0]

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy KV slots `src` to `dst` on every rank (tree drafts: the accepted path made consecutive)."""
        self.run_workers("move_kv", src, dst)

    def sleep(self) -> None:
        self.run_workers("sleep")

    def wake(self) -> None:
        self.run_workers("wake")

    def shutdown(self) -> None:  # noqa: B027 - optional: executors with processes or groups end them here
        """Stop the workers (processes, process groups); the engine calls it once, at the end."""

    # --- what in-process executors expose -------------------------------------------------------

    def _driver(self, what: str) -> Worker:
        if self.driver is None:
            raise RuntimeError(f"not supported yet: {what} with the {type(self).__name__} executor, whose rank-0 "
                               "worker is not in this process")
        return self.driver

    @property
    def lora(self) -> LoRAManager | None:
        """The LoRA slots the scheduler acquires: rank 0's, when it is the only rank and in this process (an
        executor that mirrors adapter loads to every rank overrides this); None: adapters are not supported."""
        if self.world_size > 1 or self.driver is None:
            return None
        return self.driver.lora

    @property
    def kv_caches(self) -> list[KVCache]:
        """The device KV cache of a one-rank, in-process executor (KV tiers copy blocks in and out of it)."""
        if self.world_size > 1:
            raise RuntimeError(f"not supported yet: KV tiers with the {type(self).__name__} executor "
                               f"({self.world_size} ranks)")
        return self._driver("KV tiers").kv_caches

    @property
    def draft_kv_caches(self) -> list[KVCache]:
        return self._driver("a speculator's draft KV cache").draft_kv_caches


class UniprocessExecutor(Executor):
    """One worker, in this process, on the device the hardware probe found: a replica on one device."""

    def __init__(self, config: WorkerConfig, options: Mapping[str, Any]) -> None:
        super().__init__(config, options)
        self.worker = Worker(config, self.parallel_context(0))

    @property
    def world_size(self) -> int:
        return 1

    @property
    def driver(self) -> Worker:
        return self.worker

    def run_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def execute(self, plan: StepPlan) -> StepOutput:  # the hot path: no list, no getattr
        return self.worker.execute(plan)
