"""AsyncEngine: one background thread runs the engine's step loop; asyncio callers stream outputs.

The step loop owns the engine (no locks inside the engine): callers hand it commands (add,
abort) through a queue, and it hands outputs back to each request's asyncio queue with
`call_soon_threadsafe`. torch releases the GIL in its kernels, so the event loop stays
responsive while a step runs. A caller that stops iterating (client gone) aborts its request,
and the engine frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from ember_platform.engine.engine import LLMEngine
from ember_platform.engine.outputs import RequestOutput
from ember_platform.engine.sampling_params import SamplingParams

log = logging.getLogger("ember.engine")


class EngineDeadError(RuntimeError):
    """The step loop crashed; the replica must be restarted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="ember-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_path(cls, path: str | Path, **overrides: Any) -> AsyncEngine:
        return cls(LLMEngine(path, **overrides))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, lora_name: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes. Leaving the loop early aborts it."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        request_id = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        self._send("add", (request_id, prompt, params or SamplingParams(), lora_name, cache_salt))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    # --- the engine thread ------------------------------------------------------------------

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id, prompt, params, lora_name, cache_salt = payload
                try:
                    self.engine.add_request(request_id, prompt, params, lora_name=lora_name, cache_salt=cache_salt)
                except (ValueError, TypeError) as e:
                    self._deliver(request_id, e)
            elif kind == "abort":
                self.engine.abort(payload)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                    if out.finished:
                        self.engine.forget(out.request_id)
        except BaseException as e:  # a crashed step loop must fail every waiting caller, not hang them
            log.exception("engine step loop crashed")
            self._error = e
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine stopped: {e}"))
