"""How many CPU threads a small engine step runs on: one, or torch's, whichever this machine measures faster for
steps of its size.

A batch-1 decode step of a small model is a few hundred small ops, and under `OMP_WAIT_POLICY=PASSIVE` (what a
shared machine needs, and what the benchmarks run with) every one of them that torch or a kernel splits across
threads first wakes the others. On a 2-core Zen 5 VM the example model decoded 1.35x faster on one thread than on
two (545 -> 737 tok/s), an EAGLE-3 step 1.5x; with a spinning wait policy the two were even; a larger model's
steps gain from a second thread. No constant is right everywhere, so steps are grouped by their token count
(powers of two up to `MAX_TOKENS`) and each group measures both: its first steps alternate between one thread
and torch's, the fastest of `SAMPLES` on each side decides, and every `REFRESH` steps both are measured again
(the load moves, and a growing context changes a step's cost). Steps of more tokens always run on torch's
threads. Results never depend on the thread count (the engine's ops compute the same bits on any), so the choice
only moves time.

Only for an engine whose forward passes run in this process on the CPU: torch's thread count here does nothing
for another process's workers or a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

MAX_TOKENS = 16
SAMPLES = 3  # steps timed on each side before a choice (the fastest counts: the machine's load only slows steps)
REFRESH = 256  # steps of a group between two measurements of both sides


@dataclass(slots=True)
class _Group:
    """One step size's measurements: the fastest step seen on each thread count since the last refresh."""

    fastest: dict[int, float] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)
    chosen: int = 0  # 0 while measuring
    steps: int = 0


class StepThreads:
    """The per-size choice (module docstring); `enabled` False: every step on torch's threads, unmeasured."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._groups: dict[tuple[int, int], _Group] = {}

    @staticmethod
    def group_of(num_tokens: int) -> int | None:
        """The size group of a step of `num_tokens` tokens (the next power of two), None above MAX_TOKENS."""
        if num_tokens > MAX_TOKENS:
            return None
        return 1 << max(0, num_tokens - 1).bit_length()

    @contextmanager
    def running(self, num_tokens: int) -> Iterator[None]:
        """Run the body (one step) on the thread count chosen for its size, timing it while the choice is open."""
        threads = torch.get_num_threads()
        size = self.group_of(num_tokens) if self.enabled and threads > 1 else None
        if size is None:
            yield
            return
        group = self._groups.setdefault((size, threads), _Group())
        group.steps += 1
        if group.chosen and group.steps % REFRESH == 0:  # a refresh: measure both sides again
            group.chosen, group.fastest, group.samples = 0, {}, {}
        n = group.chosen or (1 if group.samples.get(1, 0) <= group.samples.get(threads, 0) else threads)
        if n != threads:
            torch.set_num_threads(n)
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            if n != threads:
                torch.set_num_threads(threads)
            if not group.chosen:
                group.fastest[n] = min(seconds, group.fastest.get(n, seconds))
                group.samples[n] = group.samples.get(n, 0) + 1
                if min(group.samples.get(1, 0), group.samples.get(threads, 0)) >= SAMPLES:
                    group.chosen = 1 if group.fastest[1] < group.fastest[threads] else threads

    def chosen(self, num_tokens: int, threads: int | None = None) -> int | None:
        """The thread count chosen for steps of `num_tokens` tokens (None while measuring, or never run)."""
        size = self.group_of(num_tokens)
        group = self._groups.get((size, threads or torch.get_num_threads())) if size is not None else None
        return group.chosen or None if group is not None else None
