"""The replica's HTTP app: OpenAI-compatible generation over one engine, plus /health, /ready, /metrics and /info.

`create_app` builds the Starlette app over a `Replica` (core.py: the engine once loaded and warmed up, the
lifecycle state, the in-flight count, the metrics). The process around it is `server.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ember.errors import EmberError
from ember.postprocess import OutputHookError, OutputPipeline
from ember_platform.engine.sampling_params import SamplingParams
from ember_platform.gateway import request_body
from ember_platform.gateway.choices import fan_out
from ember_platform.gateway.errors import (
    ProtocolError,
    invalid_request,
    unsupported,
)
from ember_platform.gateway.preprocess import PREPROCESSED_HEADER, preprocessed_marker
from ember_platform.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
)
from ember_platform.gateway.request_body import check_text, max_body_bytes, read_body
from ember_platform.gateway.responses import (
    SSE_DONE,
    ChatStream,
    CompletionStream,
    Generation,
    chat_completion,
    new_chat_completion_id,
    new_completion_id,
    sse,
    text_completion,
)
from ember_platform.gateway.structured_outputs import compile_error
from ember_platform.replica.auth import ReplicaAuthMiddleware
from ember_platform.replica.core import (
    FAILED,
    GENERATION_PATHS,
    READY,
    Replica,
    not_serving,
)

if TYPE_CHECKING:  # the engine imports torch; the app only needs it once `load()` runs
    from ember_platform.engine.outputs import RequestOutput
    from ember_platform.tools import ToolParser

log = logging.getLogger("ember.replica")

# --- request handling -------------------------------------------------------------------------
def _error_response(error: ProtocolError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers())


class AdmissionMiddleware:
    """Admits generation requests only while the replica is ready, and counts those in flight (for the drain)."""

    def __init__(self, app: ASGIApp, replica: Replica) -> None:
        self.app = app
        self.replica = replica

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        failure = self.replica.failure
        if self.replica.state != READY or failure is not None:
            await _error_response(not_serving(self.replica.state, failure))(scope, receive, send)
            return
        self.replica.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.replica.num_in_flight -= 1


async def _read_body(request: Request, replica: Replica, *, authenticated: bool) -> dict[str, Any] | bytes:
    """The JSON object the client sent, after the package's preprocess hooks; raw bytes if it is not an object
    (the protocol layer then says what is wrong with it).

    The gateway runs the hooks before it routes (gateway/preprocess.py) and says so in `PREPROCESSED_HEADER`; that
    is believed only on a request that carried this replica's secret (`authenticated`: only a gateway has it) and
    names this package version, so a client calling a replica directly cannot skip them."""
    raw = await read_body(request, max_body_bytes())  # 413 as an OpenAI error object
    data = request_body.loads(raw) if raw else None  # a nesting limit first: never a RecursionError
    check_text(data, raw)  # lone surrogates: a 400 naming the field, before any hook or tokenizer sees them
    if not isinstance(data, dict):
        return raw
    assert replica.engine is not None
    if authenticated and request.headers.get(PREPROCESSED_HEADER) == preprocessed_marker(replica.manifest,
                                                                                         replica.digest):
        return data
    return await asyncio.to_thread(replica.engine.plugins.preprocess_request, data, replica.manifest)


def _adapter(replica: Replica, body: GenerationRequest) -> str | None:
    """The LoRA adapter a request names (`"model": "NAME:ADAPTER"`), checked against the engine's."""
    name, adapter = body.model_and_adapter
    if adapter is None:
        return None
    assert replica.engine is not None
    available = replica.engine.lora_names
    if adapter not in available:
        listed = f"its adapters: {', '.join(available)}" if available else "it serves no adapters"
        raise ProtocolError(404, f"The model '{name}' has no adapter '{adapter}' ({listed}).", "model",
                            "model_not_found")
    return adapter


def _prompt_ids(replica: Replica, body: CompletionRequest) -> list[list[int]]:
    engine = replica.engine
    assert engine is not None
    batch = []
    for index, prompt in enumerate(body.prompts()):
        param = "prompt" if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else f"prompt[{index}]"
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise invalid_request(param, f"Invalid '{param}': it must contain at least one token.")
        if max(ids) >= engine.vocab_size:
            raise invalid_request(param, f"Invalid '{param}': token ids must be in [0, {engine.vocab_size}), "
                                         f"got {max(ids)}.")
        batch.append(ids)
    return batch


def _tool_parser(replica: Replica, body: ChatCompletionRequest) -> ToolParser | None:
    """The parser that reads this request's tool calls; None when it offers the model no tools. A model without
    one cannot take tools: its calls would come back as text, so the request is refused."""
    use = body.tool_use()
    if use is None:
        return None
    if replica.tool_parser is None:
        report = replica.tool_parser_report
        why = f" ({report.reason})" if report is not None else ""
        raise invalid_request("tools", f"Invalid 'tools': the model '{replica.manifest.model.name}' has no tool-call "
                                       f"parser{why}, so its calls could not be read. Send the request without "
                                       "tools, or set [chat] tool_parser in the package's ember.toml.",
                              "unsupported_value")
    if not use.parallel:
        from ember_platform.tools.parser import FirstCallOnly

        return FirstCallOnly(replica.tool_parser)
    return replica.tool_parser


async def _constrain_tool_calls(replica: Replica, params: SamplingParams, body: ChatCompletionRequest,
                                tool_parser: ToolParser | None) -> SamplingParams:
    """tool_choice "required" or a named function: the output is forced into the parser's call format, each call's
    arguments into its tool's parameters schema. Compiled here, in a thread, like any other constraint; a schema the
    grammar engine cannot enforce is a 400 naming that tool's parameters."""
    use = body.tool_use()
    if tool_parser is None or use is None or not (use.constrained or use.strict):
        return params
    from ember_platform.engine.sampling_params import StructuredOutput
    from ember_platform.engine.structured_output import StructuredOutputError

    assert replica.engine is not None
    free_text = not use.constrained  # "auto" with strict tools: text, or calls that follow their schemas
    try:
        grammar = tool_parser.grammar(use.tools, parallel=use.parallel, free_text=free_text)
    except NotImplementedError:
        index = next(i for i, tool in enumerate(use.tools) if tool.strict)
        raise unsupported(f"tools[{index}].function.strict", f"strict tools with tool_choice 'auto' are not "
                          f"supported by this model's tool parser ({tool_parser.name}): send strict false, or "
                          "tool_choice 'required' or a named function (always constrained).") from None
    grammars = replica.engine.grammars
    structured = StructuredOutput("grammar", grammar)
    if not grammars.is_cached(structured):
        try:
            await asyncio.to_thread(grammars.compile, structured)
        except StructuredOutputError as e:
            raise await _tool_grammar_error(replica, body, e.reason) from None
    return dataclasses.replace(params, structured=structured)


async def _tool_grammar_error(replica: Replica, body: ChatCompletionRequest, reason: str) -> ProtocolError:
    """The 400 for a tool grammar the engine refused: naming the first tool whose parameters it cannot enforce
    alone (found only on this error path), else `tools` as a whole."""
    import json

    from ember_platform.engine.sampling_params import StructuredOutput
    from ember_platform.engine.structured_output import StructuredOutputError

    assert replica.engine is not None and body.tools is not None
    for index, tool in enumerate(body.tools):
        if tool.function.parameters is None:
            continue
        schema = StructuredOutput("json_schema", json.dumps(tool.function.parameters))
        try:
            await asyncio.to_thread(replica.engine.grammars.compile, schema)
        except StructuredOutputError as e:
            return compile_error(f"tools[{index}].function.parameters", e.reason)
    return compile_error("tools", reason)


def _echo_texts(replica: Replica, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """Each prompt as `echo` returns it: a text prompt as sent, token ids decoded."""
    assert replica.engine is not None
    return [prompt if isinstance(prompt, str) else replica.engine.tokenizer.decode(ids, skip_special_tokens=False)
            for prompt, ids in zip(body.prompts(), prompts, strict=True)]


def _log_user(body: GenerationRequest, response_id: str) -> None:
    """OpenAI's `user` (an end user's id, for abuse monitoring) goes to the log with the response id; never into a
    metric label, where every distinct user would be a series of its own."""
    if body.user:
        log.info("%s for user %r", response_id, body.user[:256])


def _chat_prompt_ids(replica: Replica, body: ChatCompletionRequest) -> list[int]:
    from ember_platform.engine.text.chat_template import ChatTemplateError

    assert replica.engine is not None
    try:
        ids = replica.engine.tokenizer.chat_prompt_ids(body.template_messages(), tools=body.template_tools())
    except ChatTemplateError as e:
        raise invalid_request("messages", f"Invalid 'messages': {e}.") from None
    if not ids:
        raise invalid_request("messages", "Invalid 'messages': the chat template rendered an empty prompt.")
    return ids


async def _compile_constraint(replica: Replica, body: GenerationRequest) -> None:
    """Compile the request's output constraint against the model's tokenizer here, in a thread: never on the step
    loop (the engine then finds it cached), and a schema the grammar engine cannot honor is a 400 naming the field."""
    constraint = body.output_constraint()
    if constraint is None:
        return
    from ember_platform.engine.structured_output import StructuredOutputError

    assert replica.engine is not None
    grammars = replica.engine.grammars
    if grammars.is_cached(constraint.structured):
        return
    try:
        await asyncio.to_thread(grammars.compile, constraint.structured)
    except StructuredOutputError as e:
        raise compile_error(constraint.param, e.reason) from None


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` while watching the client: if it goes first, cancel the work (aborting its engine requests).

    Returns (finished, result).
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


def _stream_error(e: Exception) -> bytes:
    """The SSE error event for a stream that cannot go on: OpenAI's error object, never a Python class or trace."""
    if isinstance(e, ProtocolError):
        return sse(e.body())
    log.exception("request failed while streaming")
    return sse(_server_error(e).body())


def _server_error(e: Exception) -> ProtocolError:
    """500 for a failure while generating or post-processing; the details (exception, traceback) go to the log."""
    if isinstance(e, OutputHookError):
        return ProtocolError(500, f"The output hook of {e.plugin} failed on this response; the replica's log has "
                                  f"the details.", None, "output_hook_failed")
    return ProtocolError(500, "The replica failed while generating this response; its log has the details.", None,
                         "internal_error")


def _output_pipelines(replica: Replica, request: dict[str, Any] | bytes | None, params: Sequence[SamplingParams],
                      *, stream: bool, wants_logprobs: bool | None = None) -> list[OutputPipeline | None]:
    """One post-processing pipeline per choice (None where no output hook applies: nothing to do).

    Per-token logprobs would carry the text before the hooks rewrote it (what a redaction hides), so a request
    asking for them while hooks apply is refused before anything is generated. `wants_logprobs`: whether the client
    asked (default: whether `params` do; best_of candidates compute them to pick the best)."""
    if request is None or replica.engine is None:
        return [None] * len(params)
    request_dict = request if isinstance(request, dict) else {}
    try:
        pipelines = [replica.engine.plugins.output_pipeline(request_dict, replica.manifest, stream=stream)
                     for _ in params]
    except OutputHookError as e:
        log.exception("an output hook failed")
        raise _server_error(e) from None
    first = next((p for p in pipelines if p is not None), None)
    if wants_logprobs is None:
        wants_logprobs = any(getattr(p, "logprobs", None) is not None for p in params)
    if first is not None and wants_logprobs:
        raise invalid_request("logprobs", f"Invalid 'logprobs': this model's output hooks ({', '.join(first.plugins)}) "
                                          "rewrite its text, and per-token logprobs would show it as generated. "
                                          "Send the request without logprobs.", "unsupported_value")
    return pipelines


def _postprocessed(out: RequestOutput, pipeline: OutputPipeline | None, token_ids: list[int]) -> RequestOutput:
    """The engine output with its text (and, at its end, finish_reason) after the choice's output hooks.

    `token_ids`: the choice's tokens so far, this output's included. Aborted outputs pass as they are (they end the
    stream with an error event); usage stays the model's."""
    if pipeline is None or out.finish_reason == "abort":
        return out
    text = pipeline.feed(out.new_text) if out.new_text else ""
    if not out.finished:
        return dataclasses.replace(out, new_text=text)
    tail, finish_reason = pipeline.finish(out.finish_reason or "stop", token_ids)
    return dataclasses.replace(out, new_text=text + tail, finish_reason=finish_reason)


def _events(replica: Replica, stream: ChatStream | CompletionStream, prompts: list[list[int]],
            params: list[SamplingParams], cache_salt: str | None, adapter: str | None = None,
            request: dict[str, Any] | bytes | None = None,
            leaders: Sequence[int | None] | None = None) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response, its text through the output hooks of `request` (the body the hooks
    see; None: no hooks). Checked before it starts: a request the hooks cannot serve is refused with its status.
    One engine request per choice; `leaders` as in `Replica.generate_many`."""
    pipelines = _output_pipelines(replica, request, params, stream=True)
    return _event_stream(replica, stream, prompts, params, cache_salt, adapter, pipelines, leaders)


async def _event_stream(replica: Replica, stream: ChatStream | CompletionStream, prompts: list[list[int]],
                        params: list[SamplingParams], cache_salt: str | None, adapter: str | None,
                        pipelines: list[OutputPipeline | None],
                        leaders: Sequence[int | None] | None = None) -> AsyncIterator[bytes]:
    """The SSE body; cancelled (client gone) it aborts the engine requests.

    One write per engine output (all of its chunks), and the last one carries `[DONE]` too: each write is a send on
    the socket here, a read and a forward in the gateway and a read in the client. Text an output hook holds back
    makes no chunk; what it lets go later, and its finish_reason, come in the chunks of later outputs.
    """
    if isinstance(stream, ChatStream):
        for chunk in stream.start():
            yield sse(chunk)
    token_ids: list[list[int]] = [[] for _ in prompts]
    try:
        async with aclosing(replica.generate_many(prompts, params, stream.id, cache_salt=cache_salt,
                                                  lora_name=adapter, leaders=leaders)) as outputs:
            async for index, out in outputs:
                if pipelines[index] is not None:
                    token_ids[index] += out.new_token_ids
                    out = _postprocessed(out, pipelines[index], token_ids[index])
                chunks = stream.add(out, index)
                if stream.done:
                    yield b"".join(map(sse, chunks)) + SSE_DONE
                    return
                if chunks:
                    yield b"".join(map(sse, chunks))
    except Exception as e:
        yield _stream_error(e) + SSE_DONE
        return
    yield SSE_DONE  # the engine's outputs ended without finishing every choice (not expected)


async def _generate(request: Request, replica: Replica, data: dict[str, Any] | bytes, prompts: list[list[int]],
                    params: list[SamplingParams], response_id: str, cache_salt: str | None, adapter: str | None,
                    respond: Callable[[list[Generation]], dict[str, Any]], *,
                    leaders: Sequence[int | None] | None = None, wants_logprobs: bool | None = None) -> Response:
    """Run a non-streaming request to the end (or until the client leaves) and build its response: one engine
    request per prompt (per choice, `leaders` as in `Replica.generate_many`)."""
    assert replica.engine is not None
    pipelines = _output_pipelines(replica, data, params, stream=False, wants_logprobs=wants_logprobs)

    async def run() -> tuple[list[Generation], list[list[int]]]:
        generations = [Generation() for _ in prompts]
        token_ids: list[list[int]] = [[] for _ in prompts]
        async with aclosing(replica.generate_many(prompts, params, response_id, cache_salt=cache_salt,
                                                  lora_name=adapter, leaders=leaders)) as outputs:
            async for index, out in outputs:
                generations[index].add(out)
                token_ids[index] += out.new_token_ids
        return generations, token_ids

    finished, result = await _unless_disconnected(request, run())
    if not finished:
        return Response(status_code=499)  # nobody is listening; the engine already dropped the requests
    generations, token_ids = result
    for generation, ids, pipeline in zip(generations, token_ids, pipelines, strict=True):
        if pipeline is None or generation.finish_reason not in ("stop", "length"):
            continue  # an aborted request answers 503 (`respond`): nothing of it is sent
        try:
            text, generation.finish_reason = pipeline.apply(generation.text, ids, generation.finish_reason)
        except OutputHookError as e:
            log.exception("an output hook failed")
            raise _server_error(e) from None
        generation.text_parts = [text]
    return JSONResponse(respond(generations))


def _sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(replica: Replica, *, secret: str | None = None) -> Starlette:
    """The replica's Starlette app. Generation routes answer 503 until `replica.load()` has run.

    With a `secret`, every route but /health, /ready and /metrics answers 401 unless the request carries it
    (replica/auth.py); None serves everyone (a replica started by hand with --no-auth, or an in-process test).
    """

    async def chat_completions(request: Request) -> Response:
        data = await _read_body(request, replica, authenticated=secret is not None)
        body = parse_chat_request(data)
        adapter = _adapter(replica, body)
        prompt = _chat_prompt_ids(replica, body)
        assert replica.engine is not None
        params = body.sampling_params_for(len(prompt), replica.engine.max_sequence_len, replica.engine.vocab_size)
        await _compile_constraint(replica, body)
        tool_parser = _tool_parser(replica, body)
        params = await _constrain_tool_calls(replica, params, body, tool_parser)
        response_id = new_chat_completion_id()
        _log_user(body, response_id)
        choices = fan_out([prompt], [params], body.num_choices)
        if body.stream:
            stream = ChatStream(model=body.model, token_text=replica.token_text, include_usage=body.include_usage,
                                logprobs=body.wants_logprobs, completion_id=response_id, n=body.num_choices,
                                tool_parser=tool_parser, token_bytes=replica.token_bytes)
            return _sse_response(_events(replica, stream, choices.prompts, choices.params, body.cache_salt, adapter,
                                         data, choices.leaders))
        return await _generate(
            request, replica, data, choices.prompts, choices.params, response_id, body.cache_salt, adapter,
            lambda generations: chat_completion(generations, model=body.model, token_text=replica.token_text,
                                                logprobs=body.wants_logprobs, completion_id=response_id,
                                                tool_parser=tool_parser, token_bytes=replica.token_bytes),
            leaders=choices.leaders)

    async def completions(request: Request) -> Response:
        data = await _read_body(request, replica, authenticated=secret is not None)
        body = parse_completion_request(data)
        adapter = _adapter(replica, body)
        prompts = _prompt_ids(replica, body)
        assert replica.engine is not None
        params = [body.candidate_params(body.sampling_params_for(len(ids), replica.engine.max_sequence_len,
                                                                 replica.engine.vocab_size))
                  for ids in prompts]
        await _compile_constraint(replica, body)
        response_id = new_completion_id()
        _log_user(body, response_id)
        echo = _echo_texts(replica, body, prompts) if body.echo else None
        n, candidates = body.num_choices, body.num_candidates
        choices = fan_out(prompts, params, candidates)
        if body.stream:  # best_of > n is refused when streamed: every candidate is a choice
            stream = CompletionStream(model=body.model, token_text=replica.token_text,
                                      include_usage=body.include_usage, logprobs=body.wants_logprobs,
                                      completion_id=response_id, num_choices=len(choices.prompts), n=n,
                                      echo=None if echo is None else [text for text in echo for _ in range(n)],
                                      echo_first_tokens=[ids[0] for ids in choices.prompts] if echo else None,
                                      scores_prompt_only=body.scores_prompt_only)
            return _sse_response(_events(replica, stream, choices.prompts, choices.params, body.cache_salt, adapter,
                                         data, choices.leaders))
        return await _generate(
            request, replica, data, choices.prompts, choices.params, response_id, body.cache_salt, adapter,
            lambda generations: text_completion(generations, model=body.model, token_text=replica.token_text,
                                                logprobs=body.wants_logprobs, completion_id=response_id,
                                                candidates=candidates, n=n, echo=echo,
                                                echo_first_tokens=[ids[0] for ids in prompts] if echo else None,
                                                scores_prompt_only=body.scores_prompt_only),
            leaders=choices.leaders, wants_logprobs=body.wants_logprobs)

    async def health(request: Request) -> Response:
        # Alive while loading or draining too; a crashed step loop is the one thing a restart fixes.
        failure = replica.failure
        if failure is not None:
            return JSONResponse({"status": "unhealthy", "error": failure}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        failure = replica.failure
        if failure is not None:
            return JSONResponse({"status": FAILED, "error": failure}, 503)
        return JSONResponse({"status": replica.state}, 200 if replica.state == READY else 503)

    async def metrics(request: Request) -> Response:
        body, content_type = replica.metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    async def info(request: Request) -> Response:
        return JSONResponse(replica.info())

    async def sleep(request: Request) -> Response:
        """Free the engine's KV cache, keep the weights: the state between warm and zero (a request wakes it)."""
        engine = replica.engine
        if engine is None or replica.status() != READY:
            return JSONResponse({"status": replica.status(), "error": "not ready"}, 409)
        if replica.num_in_flight:
            return JSONResponse({"status": "busy", "error": f"{replica.num_in_flight} request(s) in flight"}, 409)
        try:
            engine.sleep()
        except RuntimeError as e:
            return JSONResponse({"status": "busy", "error": str(e)}, 409)
        return JSONResponse({"status": "sleeping"})

    async def wake(request: Request) -> Response:
        if replica.engine is None:
            return JSONResponse({"status": replica.status(), "error": "not loaded"}, 409)
        return JSONResponse({"status": replica.status(), "wake_s": replica.engine.wake()})

    async def protocol_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProtocolError)
        return _error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:  # unknown path, wrong method
        assert isinstance(exc, HTTPException)
        error = ProtocolError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
        return JSONResponse(error.body(), exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, EmberError):  # a package hook or plugin failed: say which, as it said it
            return _error_response(ProtocolError(500, str(exc), None, "internal_error"))
        # Anything else goes to the log only: an exception's class and text can reveal internals.
        request_id = request_body.request_id(request.headers.get("x-request-id"))
        log.error("%s %s failed (request %s)", request.method, request.url.path, request_id, exc_info=exc)
        return _error_response(ProtocolError(500, f"The replica hit an internal error (request id {request_id}).",
                                             None, "internal_error"))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/info", info),
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake", wake, methods=["POST"]),
    ]
    # Auth first: a request without the secret is refused before it counts as in flight.
    middleware = [Middleware(ReplicaAuthMiddleware, secret=secret), Middleware(AdmissionMiddleware, replica=replica)]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={ProtocolError: protocol_error, HTTPException: http_error,
                                         Exception: server_error})
