"""The replica's engine side: `Replica` loads the package's engine, warms it up, tracks the lifecycle state
(starting, ready, draining, failed), the in-flight count and the metrics, and runs generations for the routes;
`app.py` serves it over HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.chat_templates import tool_template
from ember.errors import PackageError
from ember.package.lock import LOCK_NAME, Lock
from ember_platform.engine.config import resolve_source
from ember_platform.engine.sampling_params import SamplingParams
from ember_platform.gateway.errors import ProtocolError, service_unavailable
from ember_platform.replica.metrics import COLD_START_PHASES, ReplicaMetrics

if TYPE_CHECKING:  # the engine imports torch; the app only needs it once `load()` runs
    from ember.selection import SelectionReport
    from ember_platform.engine.async_engine import AsyncEngine
    from ember_platform.engine.engine import LLMEngine
    from ember_platform.engine.outputs import RequestOutput
    from ember_platform.tools import ToolParser

log = logging.getLogger("ember.replica")

STARTING, READY, DRAINING = "starting", "ready", "draining"
FAILED = "failed"  # the engine's step loop crashed: nothing more can be generated until the replica is replaced
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# A replica that is starting or draining sends clients elsewhere soon: the gateway retries on another replica.
RETRY_AFTER_SECONDS = 1.0
WARMUP_PROMPT = "Hello"
WARMUP_TOKENS = 2
# Engine counters the warm-up moves; /metrics reports requests' tokens only.
_WARMUP_COUNTERS = ("generated_tokens", "spec_draft_tokens", "spec_accepted_tokens", "prefix_cache_queried_tokens",
                    "prefix_cache_hit_tokens")
# Each SSE event costs the replica's event loop, the gateway and the client together about a millisecond of CPU
# (bench/bench_gateway.py: ~0.3 ms replica, ~0.4 ms gateway, ~0.5 ms openai client), as much as a small model
# spends per token on a CPU; and the event loop takes the GIL from the engine's step thread to do it. So the
# replica sends at most about this many events a second over all its streams, about a tenth of a core for the
# events: with few streams open each still gets every step's tokens, with many each gets a chunk every
# (streams open / rate) seconds, holding the steps since the last. First tokens and ends go out at once.
DEFAULT_STREAM_EVENT_RATE = 100.0
MAX_STREAM_INTERVAL = 0.25  # seconds: text that streams slower than this stops reading as streaming


def read_lock_digest(package_dir: Path) -> str | None:
    """The package digest from its `ember.lock`, or None when the package has no (readable) lock."""
    path = package_dir / LOCK_NAME
    if not path.is_file():
        return None
    try:
        return Lock.from_json(path.read_bytes(), source=str(path)).digest
    except (OSError, PackageError) as e:
        log.warning("%s; /info reports no digest", e)
        return None


class Replica:
    """One model served by one engine: loaded once by `load()` (weights, then a warm-up generate), then ready.

    The package and overrides are checked at construction (torch-free), so a bad command line fails before the
    HTTP server starts; the weights load in `load()`, which blocks: the server runs it in a thread.
    """

    def __init__(self, package_dir: str | Path, overrides: dict[str, Any] | None = None, *,
                 stream_event_rate: float = DEFAULT_STREAM_EVENT_RATE) -> None:
        self._started = time.perf_counter()
        self.package_dir = Path(package_dir)
        self.overrides = dict(overrides or {})
        self.source, _ = resolve_source(self.package_dir, self.overrides)
        self.manifest = self.source.manifest
        self.digest = read_lock_digest(self.source.root) if self.source.is_package else None
        self.state = STARTING
        self.engine: LLMEngine | None = None
        self.async_engine: AsyncEngine | None = None
        self.timings: dict[str, float | None] = dict.fromkeys(COLD_START_PHASES)
        self.num_in_flight = 0
        self.stream_event_rate = stream_event_rate
        self.token_text: Callable[[int], str] = self._no_tokens  # one token's text, for logprobs; set by load()
        self.token_bytes: Callable[[int], bytes] = self._no_tokens  # and its own bytes (chat logprobs' `bytes`)
        self.tool_parser: ToolParser | None = None  # reads tool calls from chat outputs; set by load()
        self.tool_parser_report: SelectionReport | None = None
        self._warmup_counters: dict[str, float] = {}
        self.metrics = ReplicaMetrics(self._request_stats, lambda: self.num_in_flight)

    # --- lifecycle --------------------------------------------------------------------------

    def load(self) -> None:
        """Load the engine, run the warm-up generate, start the step loop; then the replica is ready."""
        from ember_platform.engine.async_engine import AsyncEngine
        from ember_platform.engine.engine import LLMEngine

        engine = LLMEngine(self.package_dir, **self.overrides)
        self.timings["load"] = engine.timings["load"]
        self.timings["quantize"] = engine.timings.get("quantize", 0.0)
        self._warm_up(engine)
        self._select_tool_parser(engine)
        self.engine = engine
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: engine.tokenizer.decode([token_id], skip_special_tokens=False))
        self.token_bytes = functools.lru_cache(maxsize=1 << 16)(engine.tokenizer.token_bytes)
        self.async_engine = AsyncEngine(engine)
        self.metrics.set_cold_start(self.timings)
        if self.state == STARTING:  # a drain that began while loading wins
            self.state = READY
        log.info("replica ready: %s, cold start %s", self.manifest.reference,
                 {k: round(v, 3) for k, v in self.timings.items() if v is not None})

    def _warm_up(self, engine: LLMEngine) -> None:
        """Generate a few tokens so the first request pays no one-time costs (allocations, lazy inits)."""
        t0 = time.perf_counter()
        request_id = f"ember-warmup-{uuid.uuid4().hex}"
        params = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
        engine.add_request(request_id, engine.tokenizer.encode(WARMUP_PROMPT), params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and self.timings["first_token"] is None:
                    self.timings["first_token"] = time.perf_counter() - self._started
                if out.finished:
                    engine.forget(out.request_id)
        self.timings["warmup"] = time.perf_counter() - t0
        stats = engine.stats()
        self._warmup_counters = {key: stats[key] for key in _WARMUP_COUNTERS}

    def _select_tool_parser(self, engine: LLMEngine) -> None:
        report = engine.plugins.select_tool_parser(self.manifest, tool_template(engine.tokenizer.chat_template))
        technique = engine.plugins.techniques.get("tool_parser", report.name)
        self.tool_parser = technique.load()() if technique is not None else None
        self.tool_parser_report = report
        log.info("tool parser: %s (%s)", report.name, report.reason)

    @staticmethod
    def _no_tokens(token_id: int) -> Any:
        raise RuntimeError("the replica has no tokenizer before load()")

    def begin_drain(self) -> None:
        """Take no new generation requests (503 + Retry-After); requests in flight go on."""
        self.state = DRAINING

    @property
    def failure(self) -> str | None:
        """Why this replica can no longer generate (its engine's step loop crashed), or None while it can."""
        error = self.async_engine.error if self.async_engine is not None else None
        # What failed stays in the log (the step loop logged it with its traceback): this text reaches /health,
        # which anyone may read, and clients' error messages.
        return None if error is None else "the engine stopped after an internal error (the replica's log says which)"

    def status(self) -> str:
        """The lifecycle state, or FAILED once the engine has crashed (whatever the state was)."""
        return FAILED if self.failure is not None else self.state

    def stream_interval(self) -> float:
        """Seconds between two outputs of one request, so that all streams together keep to the event rate."""
        if self.stream_event_rate <= 0:
            return 0.0
        return min(MAX_STREAM_INTERVAL, self.num_in_flight / self.stream_event_rate)

    def close(self) -> None:
        if self.async_engine is not None:
            self.async_engine.shutdown()

    # --- introspection ----------------------------------------------------------------------

    def _request_stats(self) -> dict[str, float] | None:
        if self.engine is None:
            return None
        stats = self.engine.stats()
        for key, baseline in self._warmup_counters.items():
            stats[key] -= baseline
        return stats

    def info(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "name": self.manifest.model.name,
            "version": self.manifest.model.version,
            "digest": self.digest,
            "state": self.status(),
            "error": self.failure,
            "selections": {**{kind: report.as_dict() for kind, report in engine.selections.items()},
                           **({"tool_parser": self.tool_parser_report.as_dict()} if self.tool_parser_report else {})}
            if engine else {},
            "kernel_ops": engine.kernel_ops.describe() if engine else {},  # per op: the impls tried, in order
            "timings": dict(self.timings),
            "stats": engine.stats() if engine else None,
            "max_model_len": engine.max_model_len if engine else None,
            "requests_in_flight": self.num_in_flight,
            "sleeping": bool(engine and engine.sleeping),
        }

    # --- generation -------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       cache_salt: str | None = None, lora_name: str | None = None,
                       share_prefill_with: str | None = None) -> AsyncIterator[RequestOutput]:
        """One engine request's outputs, with its metrics. Closing the iterator early aborts the request.
        `share_prefill_with`: the id of a sibling with the same prompt, whose prefill this one reuses."""
        assert self.async_engine is not None, "generate() before load()"
        start = last = time.perf_counter()
        got_token = False
        reason = "abort"
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        try:
            async with aclosing(self.async_engine.generate(prompt_ids, params, request_id=request_id,
                                                           cache_salt=cache_salt, lora_name=lora_name,
                                                           share_prefill_with=share_prefill_with,
                                                           interval=self.stream_interval)) as outputs:
                async for out in outputs:
                    now = time.perf_counter()
                    if num_new := len(out.new_token_ids):
                        if not got_token:
                            self.metrics.time_to_first_token.observe(now - start)
                            got_token = True
                            # Tokens that came with the first (a loaded machine merges steps into one output)
                            # reached the client with it: each is a gap of 0, so every request counts one
                            # inter-token latency per token after its first, however its tokens were batched.
                            for _ in range(num_new - 1):
                                self.metrics.inter_token_latency.observe(0.0)
                        else:
                            for _ in range(num_new):
                                self.metrics.inter_token_latency.observe((now - last) / num_new)
                        last = now
                    if out.finished:
                        reason = out.finish_reason or "stop"
                    yield out
        except Exception as e:
            reason = "error"
            if self.failure is not None:  # the engine died under this request: another replica can take it
                raise not_serving(self.state, self.failure) from e
            from ember_platform.engine.async_engine import RequestFailedError

            if isinstance(e, ValueError) and not got_token:  # the engine refused the request as given: the client's
                field, _, detail = str(e).partition(": ")    # to change ("prompt: 142 tokens, but ...")
                raise ProtocolError(400, f"Invalid '{field}': {detail}" if detail else str(e),
                                    field if detail else None, "invalid_value") from None
            if isinstance(e, RequestFailedError):  # this request alone failed; the replica serves on
                log.error("request %s: %s", request_id, e)
                raise ProtocolError(500, f"Generation failed: {e}. The other requests are not affected.", None,
                                    "generation_failed", type="server_error") from None
            raise
        finally:
            self.metrics.requests_finished.labels(reason).inc()
            self.metrics.request_latency.observe(time.perf_counter() - start)

    async def generate_many(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], request_id: str,
                            *, cache_salt: str | None = None, lora_name: str | None = None,
                            leaders: Sequence[int | None] | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run one engine request per prompt concurrently; yield (prompt index, output) as they come.

        `leaders[i]`: the index of an earlier prompt, the same one, whose prefill request i reuses (n choices).
        Closing the iterator early (client gone) aborts every request still running.
        """
        if len(prompts) == 1:  # the common case: no task and queue in between, one hop less per output
            async with aclosing(self.generate(prompts[0], params[0], request_id, cache_salt=cache_salt,
                                              lora_name=lora_name)) as outputs:
                async for out in outputs:
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        def sub_id(index: int) -> str:
            return request_id if len(prompts) == 1 else f"{request_id}-{index}"

        async def pump(index: int) -> None:
            # Tasks start in creation order, so a leader's engine request is added before its siblings'.
            leader = leaders[index] if leaders is not None else None
            try:
                async with aclosing(self.generate(prompts[index], params[index], sub_id(index),
                                                  cache_salt=cache_salt, lora_name=lora_name,
                                                  share_prefill_with=None if leader is None else sub_id(leader),
                                                  )) as outputs:
                    async for out in outputs:
                        queue.put_nowait((index, out))
            except Exception as e:
                queue.put_nowait((index, e))
            else:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    remaining -= 1
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def not_serving(state: str, failure: str | None = None) -> ProtocolError:
    if failure is not None:
        message = f"This replica cannot generate any more ({failure}). Retry the request."
    elif state == DRAINING:
        message = "This replica is shutting down and takes no new requests. Retry the request."
    else:
        message = "This replica is still loading its model. Retry the request shortly."
    return service_unavailable(message, retry_after=RETRY_AFTER_SECONDS)
