"""How many threads a small native kernel call runs on: one, or torch's, whichever this machine measures faster for
that call's shape.

A decode step's linears are calls of tens of microseconds. Splitting one over two threads halves its arithmetic but
first wakes the other thread, and what that costs depends on the OpenMP wait policy and the host, not on the kernel:
on a 2-core Zen 5 VM under `OMP_WAIT_POLICY=PASSIVE` (what the benchmarks run with, and what a shared machine
needs) a wake-up cost ~50 us, so llama-150m's int4 down_proj at one row took 41 us on one thread and 86 us on two;
on an earlier VM a wake-up cost ~1 ms; with a spinning policy it is a few microseconds and two threads win. A
constant threshold is wrong on one of them, so each call shape (kernel, rows, outputs, inputs, torch's thread
count) measures both: the first calls alternate, then the faster one runs, and every `REFRESH` calls both are
measured again (the load moves). The kernels compute the same bits on any number of threads, so the choice never
changes a result.

Only calls of at most `SMALL_ROWS` rows are measured: a prefill chunk on one thread would cost a whole call's
worth for each probe, and there the arithmetic dwarfs any wake-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

SMALL_ROWS = 8
SAMPLES = 3  # calls timed on each side before a choice (the fastest of them counts: the load only slows calls)
REFRESH = 512  # calls between two measurements of both sides

T = TypeVar("T")


@dataclass(slots=True)
class _Shape:
    """One call shape's measurements: the fastest call seen on each side since the last refresh."""

    fastest: dict[int, float] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)
    chosen: int = 0  # 0 while measuring
    calls: int = 0


class ThreadChoice:
    """The per-shape choice (module docstring). Not locked: a lost update between threads costs one sample."""

    def __init__(self) -> None:
        self._shapes: dict[Hashable, _Shape] = {}

    def run(self, key: Hashable, rows: int, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args, num_threads)` (a native kernel's call: the thread count last), with the number chosen for
        `key` (the call shape) where `rows` is small enough to measure, else torch's."""
        threads = torch.get_num_threads()
        if threads <= 1 or rows > SMALL_ROWS:
            return fn(*args, threads)
        shape = self._shapes.get((key, threads))
        if shape is None:
            shape = self._shapes[(key, threads)] = _Shape()
        shape.calls += 1
        if shape.chosen and shape.calls % REFRESH:
            return fn(*args, shape.chosen)
        if shape.chosen:  # a refresh: measure both sides again
            shape.chosen, shape.fastest, shape.samples = 0, {}, {}
        n = 1 if shape.samples.get(1, 0) <= shape.samples.get(threads, 0) else threads
        started = time.perf_counter()
        out = fn(*args, n)
        seconds = time.perf_counter() - started
        shape.fastest[n] = min(seconds, shape.fastest.get(n, seconds))
        shape.samples[n] = shape.samples.get(n, 0) + 1
        if min(shape.samples.get(1, 0), shape.samples.get(threads, 0)) >= SAMPLES:
            shape.chosen = 1 if shape.fastest[1] < shape.fastest[threads] else threads
        return out

    def chosen(self, key: Hashable, threads: int | None = None) -> int | None:
        """The thread count chosen for `key` (None while it is measured, or never called): for tests and metrics."""
        shape = self._shapes.get((key, threads or torch.get_num_threads()))
        return shape.chosen or None if shape is not None else None


THREADS = ThreadChoice()
