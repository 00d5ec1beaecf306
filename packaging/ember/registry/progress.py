"""A byte-count progress bar on stderr that appears only for transfers that last more than a
second, and only on a terminal: quick pushes and pipelines stay quiet."""

from __future__ import annotations

import threading
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

SHOW_AFTER_S = 1.0


class TransferProgress:
    """Use as a context manager; `advance` may be called from any thread."""

    def __init__(self, description: str, total_bytes: int, *, console: Console | None = None,
                 delay: float = SHOW_AFTER_S) -> None:
        self.description = description
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._console = console or Console(stderr=True)
        self._delay = delay
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._closed = False

    def __enter__(self) -> TransferProgress:
        if self._console.is_terminal and self.total_bytes > 0:
            # A timer rather than a check in `advance`: one slow blob may report nothing for a while.
            self._timer = threading.Timer(self._delay, self._show)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            if self._progress is not None:
                self._progress.stop()

    @property
    def shown(self) -> bool:
        return self._progress is not None

    def advance(self, num_bytes: int) -> None:
        with self._lock:
            self.done_bytes += num_bytes
            if self._progress is not None and self._task is not None:
                self._progress.update(self._task, completed=self.done_bytes)

    def _show(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                TimeRemainingColumn(), console=self._console, transient=True,
            )
            self._task = self._progress.add_task(self.description, total=self.total_bytes,
                                                 completed=self.done_bytes)
            self._progress.start()
