"""AsyncEngine: one background thread runs the engine's step loop; asyncio callers stream outputs.

The step loop owns the engine (no locks inside the engine): callers hand it commands (add,
abort) through a queue, and it hands each step's outputs back to the event loop(s) with one
`call_soon_threadsafe` per loop per step. Every wake-up of the event loop thread competes with
the step loop for the GIL, so one per step, not one per request, keeps the steps fast. A
request's outputs that arrive before its caller took the previous one are merged into it:
a caller that falls behind gets fewer, larger outputs, never a backlog. A caller that stops
iterating (client gone) aborts its request, and the engine frees its KV blocks before the
next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from ember_platform.engine.engine import LLMEngine
from ember_platform.engine.outputs import RequestOutput
from ember_platform.engine.sampling_params import SamplingParams

log = logging.getLogger("ember.engine")


class EngineDeadError(RuntimeError):
    """The step loop crashed; the replica must be restarted."""


class RequestFailedError(RuntimeError):
    """The engine failed on this one request (its other requests go on); the message says what failed."""


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output that says what `first` and then `then` (the same request's next steps) said."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = [*(first.logprobs or ()), *(then.logprobs or ())]
    return RequestOutput(first.request_id, first.new_token_ids + then.new_token_ids, first.new_text + then.new_text,
                         then.finished, then.finish_reason, then.stop_reason, then.usage, logprobs, then.error,
                         first.prompt_logprobs or then.prompt_logprobs)


class _OutputStream:
    """One request's outputs on their way to its caller, touched only on the caller's event loop.

    Outputs merge while they wait. The caller is woken only when `get` would return: the request failed, or its
    pending output is due (`not_before` passed, or it finishes the request). Whether it is due is checked as
    outputs arrive, once per step for every stream at once, so holding outputs back costs no wake-ups of its own;
    a timer at `not_before + hold` only covers a request whose steps stalled (preempted) while others went on.
    """

    __slots__ = ("error", "hold", "loop", "not_before", "pending", "timer", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: RequestOutput | None = None
        self.error: Exception | None = None
        self.not_before = 0.0  # loop time before which a pending output is held, unless it finishes the request
        self.hold = 0.0  # the interval that set `not_before`
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def _due(self) -> bool:
        pending = self.pending
        return pending is not None and (pending.finished or self.error is not None
                                        or self.loop.time() >= self.not_before)

    def _stall_timer(self, waiter: asyncio.Future[None]) -> None:
        if self.timer is None:
            self.timer = self.loop.call_at(self.not_before + self.hold, _wake, waiter)

    def put(self, item: RequestOutput | Exception) -> None:
        if isinstance(item, Exception):
            self.error = item
        else:
            self.pending = item if self.pending is None else merge_outputs(self.pending, item)
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self.error is not None or self._due():
            waiter.set_result(None)
        else:
            self._stall_timer(waiter)

    async def get(self) -> RequestOutput:
        """Everything that arrived since the last call, as one output, once due; raises the error once everything
        before it is taken."""
        while not self._due():
            if self.error is not None:
                raise self.error
            self.waiter = waiter = self.loop.create_future()
            if self.pending is not None:
                self._stall_timer(waiter)
            try:
                await waiter
            finally:
                self.waiter = None
                if self.timer is not None:
                    self.timer.cancel()
                    self.timer = None
        item, self.pending = self.pending, None
        assert item is not None
        return item


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _put_all(items: list[tuple[_OutputStream, RequestOutput | Exception]]) -> None:
    for stream, item in items:
        stream.put(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _OutputStream] = {}
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

    @property
    def error(self) -> BaseException | None:
        """Why the step loop stopped, if it crashed: then every request fails, and the engine must be replaced."""
        return self._error

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, lora_name: str | None = None,
                       cache_salt: str | None = None, share_prefill_with: str | None = None,
                       interval: float | Callable[[], float] = 0.0) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes. Leaving the loop early aborts it.

        Each output covers one or more engine steps: those that finished since the previous one was taken. With
        an `interval` (seconds; or a function giving it, asked after each output, so it can follow the load),
        the outputs after the first with text come at most about that often (at the first step past it), each
        merging the steps since the last; the one that finishes the request comes at once.
        `share_prefill_with`: a sibling's request id (LLMEngine.add_request); commands run in the order sent, so
        a sibling whose generate started first was added first.
        """
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _OutputStream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        if self._error is not None:  # it crashed after the check above, and failed only the streams it saw
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"the engine stopped: {self._error}")
        self._send("add", (request_id, prompt, params or SamplingParams(), lora_name, cache_salt, share_prefill_with))
        finished = False
        # Nothing is held until some text went out: a first token may be part of a UTF-8 character, with no text.
        shown = False
        try:
            while True:
                item = await stream.get()
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
                if finished:
                    return
                shown = shown or bool(item.new_text)
                hold = (interval() if callable(interval) else interval) if shown else 0.0
                if hold > 0:
                    stream.not_before, stream.hold = stream.loop.time() + hold, hold
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

    def _deliver(self, items: Sequence[tuple[str, RequestOutput | Exception]]) -> None:
        """Hand items to their streams: one event-loop wake-up per loop, however many requests they are for."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_OutputStream, RequestOutput | Exception]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is left to read its streams
                loop.call_soon_threadsafe(_put_all, batch)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id, prompt, params, lora_name, cache_salt, share_prefill_with = payload
                try:
                    self.engine.add_request(request_id, prompt, params, lora_name=lora_name, cache_salt=cache_salt,
                                            share_prefill_with=share_prefill_with)
                except Exception as e:  # a request the engine cannot take fails alone
                    if not isinstance(e, ValueError | TypeError):
                        log.exception("request %s could not be added", request_id)
                    self._deliver([(request_id, e)])
            elif kind == "abort":
                try:
                    self.engine.abort(payload)
                except Exception:
                    log.exception("aborting request %s failed", payload)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._deliver([(out.request_id, out) for out in outputs])
                for out in outputs:
                    if out.finished:
                        self.engine.forget(out.request_id)
        except BaseException as e:  # a crashed step loop must fail every waiting caller, not hang them
            log.exception("engine step loop crashed")
            self._error = e
            dead = EngineDeadError(f"the engine stopped: {e}")
            self._deliver([(request_id, dead) for request_id in list(self._streams)])
