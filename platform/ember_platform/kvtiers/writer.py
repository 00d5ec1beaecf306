"""A background thread per lower tier that writes blocks behind a bounded queue: the engine's step loop hands a
block over in O(1) and never waits; when a tier falls behind, new blocks are dropped (and counted) instead."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember_platform.engine.block_hash import BlockHash

log = logging.getLogger("ember.kvtiers")


@dataclass(slots=True)
class WriteJob:
    block_hash: BlockHash
    data: Any  # the block's tensor; it stays valid until `done` runs (a pinned CPU-tier slot, or a copy)
    done: Callable[[], None] | None = None


_STOP = object()


class AsyncWriter:
    """Runs `write(job)` for each submitted job on its own thread; `idle()` every `idle_s` when given."""

    def __init__(self, name: str, write: Callable[[WriteJob], None], *, max_pending: int = 256,
                 idle: Callable[[], None] | None = None, idle_s: float = 60.0) -> None:
        self.name = name
        self._write = write
        self._idle = idle
        self._idle_s = idle_s
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self.num_written = 0
        self.num_dropped = 0  # the queue was full
        self.num_failed = 0  # write raised (the tier logs why)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ember-kv-{name}-writer", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return self._queue.qsize()

    def submit(self, job: WriteJob) -> bool:
        """Queue a write; False (the job's `done` already run) when the queue is full or the writer closed."""
        if not self._closed.is_set():
            try:
                self._queue.put_nowait(job)
                return True
            except queue.Full:
                pass
        self.num_dropped += 1
        if job.done is not None:
            job.done()
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far is written (or dropped); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float = 5.0, *, drop: bool = False) -> None:
        """Write what is queued (up to `timeout`; with `drop`, drop it), then stop the thread (joined, up to
        `timeout`: a thread left running into interpreter shutdown may crash it)."""
        if not drop:
            self.flush(timeout)
        self._closed.set()  # the thread stops after its current job even if the queue is full
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _drain(self, job: Any) -> None:
        """Stopping: release every job left (their `done` unpins memory) without writing it."""
        while True:
            if isinstance(job, WriteJob):
                self.num_dropped += 1
                if job.done is not None:
                    job.done()
            self._queue.task_done()
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        next_idle = time.monotonic() + self._idle_s
        while True:
            try:
                job = self._queue.get(timeout=max(0.0, next_idle - time.monotonic()) if self._idle else None)
            except queue.Empty:
                job = None
            if job is _STOP or self._closed.is_set():
                if job is not None:
                    self._drain(job)
                return
            if job is not None:
                try:
                    self._write(job)
                    self.num_written += 1
                except Exception as e:  # a tier that failed must not kill the thread: the block is just not there
                    self.num_failed += 1
                    log.debug("KV %s tier: writing block %s failed: %s", self.name, job.block_hash.hex(), e)
                finally:
                    if job.done is not None:
                        job.done()
                    self._queue.task_done()
            if self._idle is not None and time.monotonic() >= next_idle:
                next_idle = time.monotonic() + self._idle_s
                try:
                    self._idle()
                except Exception as e:
                    log.debug("KV %s tier: periodic task failed: %s", self.name, e)
