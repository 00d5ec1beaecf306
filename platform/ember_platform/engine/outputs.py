"""What the engine streams back for each request, step by step, and what `LLM.generate` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember_platform.engine.sampler import TokenLogprobs


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """One step's news about one request: new token ids and the text they complete."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    usage: Usage
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    error: str | None = None  # with finish_reason "error": what failed (the engine itself goes on)
    # With params.prompt_logprobs, on the request's first output: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """A finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # finish_reason "error": the engine failed on this request
