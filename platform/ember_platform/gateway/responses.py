"""OpenAI response objects from engine outputs: chat.completion, text_completion, their stream chunks, and SSE.

Engine outputs are `RequestOutput`s (or anything with the same attributes); each carries one step's new text, the
usage so far, and one `TokenLogprobs` per new token when logprobs were asked for. Token strings for logprobs come
from `token_text(id)`, the caller's decode of one id.

With several choices per prompt (`n`, `best_of`), generations come prompt by prompt, `candidates` per prompt
(gateway/choices.py): usage counts each prompt's tokens once and every candidate's completion tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember_platform.gateway.choices import best_of
from ember_platform.gateway.errors import request_aborted

if TYPE_CHECKING:  # the engine's modules import torch; these are only read here, by attribute
    from ember_platform.engine.outputs import RequestOutput, Usage
    from ember_platform.engine.sampler import TokenLogprobs
    from ember_platform.tools import ToolCallStream, ToolParser

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]  # one token's own bytes (part of a character, for a byte-level token)

SSE_DONE = b"data: [DONE]\n\n"
# JSON has no -inf. OpenAI writes this value for a token too unlikely to have a meaningful logprob.
UNLIKELY_LOGPROB = -9999.0


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _total_usage(usages: Iterable[Usage | None], candidates: int = 1) -> dict[str, Any]:
    """Usage of a whole response: `usages` in item order, `candidates` consecutive items per prompt. A prompt is
    counted once (its first candidate's: the one that computed it), completion tokens of every candidate."""
    items = list(usages)
    prompts = [u for u in items[::candidates] if u is not None]
    return usage_object(sum(u.prompt_tokens for u in prompts), sum(u.completion_tokens for u in items if u),
                        sum(u.cached_tokens for u in prompts))


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY_LOGPROB


def _openai_finish_reason(reason: str | None) -> str:
    # OpenAI knows "stop" and "length", and "content_filter" (which an output hook may set, ember.postprocess);
    # an aborted request has no successful answer.
    if reason == "abort":
        raise request_aborted()
    if reason not in ("stop", "length", "content_filter"):
        raise ValueError(f"not a finished engine output: finish_reason={reason!r}")
    return reason


def _chat_token(token_id: int, logprob: float, token_text: TokenText,
                token_bytes: TokenBytes | None = None) -> dict[str, Any]:
    token = token_text(token_id)
    raw = token_bytes(token_id) if token_bytes is not None else token.encode("utf-8")
    return {"token": token, "logprob": _finite(logprob), "bytes": list(raw)}


def chat_logprobs(logprobs: Iterable[TokenLogprobs], token_text: TokenText,
                  token_bytes: TokenBytes | None = None) -> dict[str, Any]:
    """Chat's `choice.logprobs`: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}.

    `bytes` are the token's own (`token_bytes`; else its text's): a token holding part of a UTF-8 character has the
    text U+FFFD, and a client rebuilds the character from the bytes of consecutive tokens."""
    return {"content": [
        {**_chat_token(lp.token_id, lp.logprob, token_text, token_bytes),
         "top_logprobs": [_chat_token(token_id, logprob, token_text, token_bytes) for token_id, logprob in lp.top]}
        for lp in logprobs
    ]}


def completion_logprobs(logprobs: Iterable[TokenLogprobs], token_text: TokenText, text_offset: int = 0, *,
                        first_token_id: int | None = None) -> tuple[dict[str, Any], int]:
    """The completions API's `choice.logprobs`, and the text offset after its last token.

    `top_logprobs` maps token strings to logprobs: the top alternatives plus the sampled token, as OpenAI's
    legacy API does (so up to logprobs+1 entries). Offsets count characters of the token strings from
    `text_offset` (the start of the choice's text). With `echo`, `logprobs` start with the prompt's (tokens 2..)
    and `first_token_id` is the prompt's first token, which has no logprob (null), as at OpenAI.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if first_token_id is not None:
        token = token_text(first_token_id)
        tokens.append(token)
        token_logprobs.append(None)
        top_logprobs.append(None)
        offsets.append(text_offset)
        text_offset += len(token)
    for lp in logprobs:
        token = token_text(lp.token_id)
        tokens.append(token)
        token_logprobs.append(_finite(lp.logprob))
        top: dict[str, float] = {}
        for token_id, logprob in lp.top:  # most likely first: keep the first of ids that decode alike
            top.setdefault(token_text(token_id), _finite(logprob))
        top.setdefault(token, _finite(lp.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
             "text_offset": offsets}, text_offset)


@dataclass(slots=True)
class Generation:
    """One request's engine outputs gathered into the whole answer, for a non-streaming response."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # with echo and logprobs

    @classmethod
    def collect(cls, outputs: Iterable[RequestOutput]) -> Generation:
        generation = cls()
        for output in outputs:
            generation.add(output)
        return generation

    def add(self, output: RequestOutput) -> None:
        self.text_parts.append(output.new_text)
        if output.logprobs:
            self.logprobs.extend(output.logprobs)
        if getattr(output, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.usage = output.usage  # the engine's usage is the running total
        if output.finished:
            self.finish_reason = output.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def chat_message(text: str, finish_reason: str, tool_parser: ToolParser | None = None) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished choice, and its finish_reason: with a `tool_parser`, the calls the text
    holds go into `tool_calls` (content null when there is nothing else) and a choice that stopped on its own
    finishes with "tool_calls"."""
    if tool_parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    from ember_platform.tools import parse_tool_calls

    content, calls = parse_tool_calls(tool_parser, text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": [call.as_openai() for call in calls]}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def chat_completion(generations: Generation | Sequence[Generation], *, model: str, token_text: TokenText,
                    logprobs: bool = False, completion_id: str | None = None, created: int | None = None,
                    tool_parser: ToolParser | None = None, token_bytes: TokenBytes | None = None) -> dict[str, Any]:
    """A `chat.completion` object: one choice per generation (the n choices of its one prompt). Raises
    ProtocolError (503) if one was aborted."""
    if isinstance(generations, Generation):
        generations = [generations]
    choices = []
    for index, generation in enumerate(generations):
        message, finish_reason = chat_message(generation.text, _openai_finish_reason(generation.finish_reason),
                                              tool_parser)
        choices.append({
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(generation.logprobs, token_text, token_bytes) if logprobs else None,
            "finish_reason": finish_reason,
        })
    return {
        "id": completion_id or new_chat_completion_id(),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": _total_usage([g.usage for g in generations], len(generations)),
    }


def text_completion(generations: Sequence[Generation], *, model: str, token_text: TokenText,
                    logprobs: bool = False, completion_id: str | None = None, created: int | None = None,
                    candidates: int = 1, n: int | None = None, echo: Sequence[str] | None = None,
                    echo_first_tokens: Sequence[int] | None = None, scores_prompt_only: bool = False) -> dict[str, Any]:
    """A `text_completion` object: `candidates` generations per prompt of the batch, of which the `n` (default: all)
    most likely are the choices, numbered prompt by prompt; usage sums every candidate's completion tokens.
    `echo`: each prompt's text, put before its choices' text; with logprobs, `echo_first_tokens` (each prompt's first
    token id) and the generations' prompt_logprobs give the prompt's tokens their logprobs too.
    `scores_prompt_only` (echo with max_tokens 0): the choices hold the prompt alone."""
    n = candidates if n is None else n
    if scores_prompt_only:
        generations = [prompt_only(g) for g in generations]
    choices = []
    for index, generation in enumerate(best_of(generations, candidates, n)):
        finish_reason = _openai_finish_reason(generation.finish_reason)
        choices.append({
            "text": (echo[index // n] if echo is not None else "") + generation.text,
            "index": index,
            "logprobs": _choice_logprobs(generation, token_text, echo_first_tokens[index // n]
                                         if echo_first_tokens is not None else None) if logprobs else None,
            "finish_reason": finish_reason,
        })
    return {
        "id": completion_id or new_completion_id(),
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": _total_usage([g.usage for g in generations], candidates),
    }


def prompt_only(generation: Generation) -> Generation:
    """The generation without its sampled tokens (echo with max_tokens 0: the one the engine made is not asked for)."""
    usage = dataclasses.replace(generation.usage, completion_tokens=0) if generation.usage is not None else None
    return dataclasses.replace(generation, text_parts=[], logprobs=[], usage=usage)


def _choice_logprobs(generation: Generation, token_text: TokenText, first_token_id: int | None) -> dict[str, Any]:
    if first_token_id is None:
        return completion_logprobs(generation.logprobs, token_text)[0]
    return completion_logprobs([*(generation.prompt_logprobs or ()), *generation.logprobs], token_text,
                               first_token_id=first_token_id)[0]


class _Stream:
    """Turns engine outputs into the chunks of one streamed response; send each with `sse`, then `SSE_DONE`."""

    object_name: str

    def __init__(self, *, model: str, token_text: TokenText, include_usage: bool = False, logprobs: bool = False,
                 completion_id: str, created: int | None = None, num_choices: int = 1, n: int = 1) -> None:
        self.id = completion_id
        self.n = n  # consecutive choices per prompt: usage counts each prompt once
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.token_text = token_text
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.num_choices = num_choices
        self._usage: dict[int, Usage] = {}
        self._finished: set[int] = set()
        self.done = False  # everything is sent but SSE_DONE

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:  # OpenAI: with include_usage, every chunk has the key, null but on the last
            chunk["usage"] = None
        return chunk

    def _step(self, output: RequestOutput, index: int) -> list[dict[str, Any]]:
        """Chunks for one output: its new text (if any), then its finish chunk, then usage when all are done."""
        if self.done:
            raise RuntimeError("the stream has already ended")
        if output.finish_reason == "abort":
            self.done = True
            return [request_aborted().body()]  # an error event: OpenAI's clients raise it as an APIError
        chunks = []
        logprobs = output.logprobs if self.logprobs else None
        if output.new_text or logprobs:
            chunks.extend(self._chunk([c]) for c in self._text_choices(index, output.new_text, logprobs or []))
        self._usage[index] = output.usage
        if output.finished:
            finish_reason = _openai_finish_reason(output.finish_reason)
            chunks.extend(self._chunk([c]) for c in self._finish_choices(index, finish_reason))
            self._finished.add(index)
            if len(self._finished) == self.num_choices:
                self.done = True
                if self.include_usage:
                    usages = [self._usage.get(i) for i in range(self.num_choices)]
                    chunks.append({**self._chunk([]), "usage": _total_usage(usages, self.n)})
        return chunks

    def _text_choices(self, index: int, text: str, logprobs: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        return [self._content_choice(index, text, logprobs)]

    def _finish_choices(self, index: int, finish_reason: str) -> list[dict[str, Any]]:
        return [self._finish_choice(index, finish_reason)]

    def _content_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        raise NotImplementedError

    def _finish_choice(self, index: int, finish_reason: str) -> dict[str, Any]:
        raise NotImplementedError


class ChatStream(_Stream):
    """`chat.completion.chunk`s as OpenAI streams them.

    A first chunk per choice with delta {"role": "assistant", "content": ""}; a content chunk per engine step that
    produced text; a chunk with an empty delta and the finish_reason; with include_usage, a last chunk with
    `choices: []` and the usage (every other chunk then carries `"usage": null`). With n choices each chunk carries
    one, named by its index.

    With a `tool_parser`, the text goes through a `ToolCallStream` per choice: content chunks for text, a chunk
    per tool-call delta (the call's opening, then its arguments' fragments), never call markup as content; a
    choice that made calls and stopped on its own finishes with "tool_calls".
    """

    object_name = "chat.completion.chunk"

    def __init__(self, *, model: str, token_text: TokenText, include_usage: bool = False, logprobs: bool = False,
                 completion_id: str | None = None, created: int | None = None, n: int = 1,
                 tool_parser: ToolParser | None = None, token_bytes: TokenBytes | None = None) -> None:
        super().__init__(model=model, token_text=token_text, include_usage=include_usage, logprobs=logprobs,
                         completion_id=completion_id or new_chat_completion_id(), created=created, num_choices=n,
                         n=n)
        self._started = False
        self.tool_parser = tool_parser
        self.token_bytes = token_bytes
        self._tool_streams: dict[int, ToolCallStream] = {}

    def start(self) -> list[dict[str, Any]]:
        """The role chunks, once; `add` sends them first if this was not called (call it to flush headers early)."""
        if self._started:
            return []
        self._started = True
        return [self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for index in range(self.num_choices)]

    def add(self, output: RequestOutput, index: int = 0) -> list[dict[str, Any]]:
        """The chunks (maybe none) that one engine output of choice `index` adds to the stream."""
        if not 0 <= index < self.num_choices:
            raise IndexError(f"choice index {index} out of range for {self.num_choices} choices")
        return self.start() + self._step(output, index)

    def _content_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text},
                "logprobs": chat_logprobs(logprobs, self.token_text, self.token_bytes) if self.logprobs else None,
                "finish_reason": None}

    def _finish_choice(self, index: int, finish_reason: str) -> dict[str, Any]:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}

    def _tool_stream(self, index: int) -> ToolCallStream | None:
        if self.tool_parser is None:
            return None
        if index not in self._tool_streams:
            from ember_platform.tools import ToolCallStream

            self._tool_streams[index] = ToolCallStream(self.tool_parser)
        return self._tool_streams[index]

    def _text_choices(self, index: int, text: str, logprobs: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        stream = self._tool_stream(index)
        if stream is None:
            return super()._text_choices(index, text, logprobs)
        return [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                for delta in stream.feed(text)]

    def _finish_choices(self, index: int, finish_reason: str) -> list[dict[str, Any]]:
        stream = self._tool_stream(index)
        if stream is None:
            return super()._finish_choices(index, finish_reason)
        choices = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                   for delta in stream.finish()]
        if stream.made_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return [*choices, self._finish_choice(index, finish_reason)]


class CompletionStream(_Stream):
    """Streamed `text_completion` objects as OpenAI sends them.

    A chunk per engine step that produced text; a chunk with text "" and the finish_reason per choice; with
    include_usage, a last chunk with `choices: []` and the usage summed over the choices (`n` per prompt: choice
    `prompt * n + j`). `echo`: per choice, the prompt text its first chunk starts with.
    """

    object_name = "text_completion"

    def __init__(self, *, model: str, token_text: TokenText, include_usage: bool = False, logprobs: bool = False,
                 completion_id: str | None = None, created: int | None = None, num_choices: int = 1, n: int = 1,
                 echo: Sequence[str] | None = None, echo_first_tokens: Sequence[int] | None = None,
                 scores_prompt_only: bool = False) -> None:
        super().__init__(model=model, token_text=token_text, include_usage=include_usage, logprobs=logprobs,
                         completion_id=completion_id or new_completion_id(), created=created,
                         num_choices=num_choices, n=n)
        self._text_offsets = [0] * num_choices
        self._echo = list(echo) if echo is not None else None
        self._scores_prompt_only = scores_prompt_only  # echo with max_tokens 0: sampled tokens are left out
        # Per choice: its prompt's first token, for the first chunk's logprobs (echo with logprobs); None once sent.
        self._first_tokens: list[int | None] = list(echo_first_tokens) if echo_first_tokens is not None \
            else [None] * num_choices

    def add(self, output: RequestOutput, index: int = 0) -> list[dict[str, Any]]:
        """The chunks (maybe none) that one engine output of choice `index` (`prompt * n + j`) adds."""
        if not 0 <= index < self.num_choices:
            raise IndexError(f"choice index {index} out of range for {self.num_choices} choices")
        if self._scores_prompt_only and output.finish_reason != "abort":
            output = dataclasses.replace(output, new_token_ids=[], new_text="", logprobs=None,
                                         usage=dataclasses.replace(output.usage, completion_tokens=0))
        if self._echo is not None and self._echo[index] and output.finish_reason != "abort":
            prompt_logprobs = getattr(output, "prompt_logprobs", None) if self.logprobs else None
            logprobs = output.logprobs if prompt_logprobs is None else [*prompt_logprobs, *(output.logprobs or ())]
            output = dataclasses.replace(output, new_text=self._echo[index] + output.new_text, logprobs=logprobs)
            self._echo[index] = ""  # sent: only the first chunk of the choice carries the prompt
        return self._step(output, index)

    def _content_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        choice_logprobs = None
        if self.logprobs:
            first, self._first_tokens[index] = self._first_tokens[index], None
            choice_logprobs, self._text_offsets[index] = completion_logprobs(logprobs, self.token_text,
                                                                             self._text_offsets[index],
                                                                             first_token_id=first)
        return {"text": text, "index": index, "logprobs": choice_logprobs, "finish_reason": None}

    def _finish_choice(self, index: int, finish_reason: str) -> dict[str, Any]:
        return {"text": "", "index": index, "logprobs": None, "finish_reason": finish_reason}
