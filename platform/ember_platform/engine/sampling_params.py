"""Per-request sampling settings, validated when built so that a bad value fails before it reaches the engine.

Torch-free on purpose: the HTTP layer builds these to validate a request without loading the engine.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

MAX_LOGPROBS = 20
# OpenAI's limits on logit_bias: at most this many token ids, each biased by at most this much either way
# (+-100 is meant to force or ban a token outright).
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0
# Below this a temperature counts as 0 (greedy): dividing logits by it would overflow float32.
GREEDY_TEMPERATURE = 1e-5


class SamplingParamsError(ValueError):
    """An invalid sampling parameter. `.field` names it, so the HTTP layer can answer 400 about that param."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _fail(field: str, allowed: str, value: object) -> SamplingParamsError:
    return SamplingParamsError(field, f"{field} must be {allowed}, got {value!r}")


def _real(field: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _fail(field, f"a number {allowed}", value)
    return float(value)


def _integer(field: str, value: object, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(field, f"an integer {allowed}", value)
    return int(value)


StructuredKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
STRUCTURED_KINDS: tuple[str, ...] = get_args(StructuredKind)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output, enforced token by token by the engine's grammar matcher.

    `spec` is text, so the pair is hashable and is the grammar cache's key:
    - json_schema: the JSON text of a JSON Schema;
    - json_object: any JSON object (spec ignored, conventionally "");
    - regex: a regular expression the whole output must match;
    - grammar: a Lark grammar in llguidance's syntax (which allows `%json {...}` inline for a schema);
    - choice: the JSON text of a list of strings; the output is exactly one of them.
    Only the shape is checked here; whether the grammar engine can honor the spec is checked when it is compiled
    against the model's tokenizer (the replica's edge), which names the unsupported feature.
    """

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise _fail("structured.kind", f"one of {', '.join(STRUCTURED_KINDS)}", self.kind)
        if not isinstance(self.spec, str):
            raise _fail("structured.spec", "a string", self.spec)
        if self.kind in ("regex", "grammar") and not self.spec:
            raise _fail("structured.spec", f"a non-empty {self.kind}", self.spec)
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError as e:
                raise SamplingParamsError("structured.spec", f"{self.kind} spec is not valid JSON: {e}") from None
            if self.kind == "json_schema" and not isinstance(value, dict | bool):
                raise _fail("structured.spec", "a JSON Schema (an object or a boolean)", value)
            if self.kind == "choice" and (not isinstance(value, list) or not value
                                          or not all(isinstance(c, str) and c for c in value)):
                raise _fail("structured.spec", "a non-empty JSON list of non-empty strings", value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...] | None:
    if value is None:
        return None
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    if isinstance(pairs, str) or not isinstance(pairs, Sequence):
        raise _fail("logit_bias", "a map of token id to bias", value)
    bias: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise _fail("logit_bias", "a map of token id to bias", value)
        token_id = _integer("logit_bias", pair[0], ">= 0 as a key")
        if token_id < 0:
            raise _fail("logit_bias", "keyed by token ids >= 0", pair[0])
        amount = _real("logit_bias", pair[1], f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if not -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                                    f"{MAX_LOGIT_BIAS:g}], got {pair[1]!r} for token {token_id}")
        bias[token_id] = amount
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise SamplingParamsError("logit_bias", f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                                                f"got {len(bias)}")
    return tuple(sorted(bias.items())) or None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    Frozen: change a copy with `dataclasses.replace`, which validates again.
    """

    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off; over prompt + output tokens
    presence_penalty: float = 0.0  # in [-2, 2]; over output tokens
    frequency_penalty: float = 0.0  # in [-2, 2]; over output tokens
    seed: int | None = None
    max_tokens: int | None = None  # None = up to the context limit
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens are out
    stop: str | Sequence[str] = ()  # normalized to tuple[str, ...]
    stop_token_ids: Sequence[int] = ()  # normalized to tuple[int, ...]
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to return besides the sampled token's own logprob
    structured: StructuredOutput | None = None  # constrain the output to a schema / regex / grammar / choice
    # Added to the logits of these token ids before sampling; normalized to a tuple of (id, bias) sorted by id.
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
    # The logprob of each prompt token after the first (given the ones before it) and this many alternatives; the
    # whole prompt is then computed (never read from the prefix cache), as those logits are needed.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalized values are written once, here
        temperature = _real("temperature", self.temperature, ">= 0")
        if temperature < 0:
            raise _fail("temperature", ">= 0", self.temperature)
        set_(self, "temperature", temperature)

        top_p = _real("top_p", self.top_p, "in (0, 1]")
        if not 0 < top_p <= 1:
            raise _fail("top_p", "in (0, 1]", self.top_p)
        set_(self, "top_p", top_p)

        top_k = _integer("top_k", self.top_k, "(-1 or 0 for off, else >= 1)")
        if top_k < -1:
            raise _fail("top_k", "-1 or 0 (off) or >= 1", self.top_k)
        set_(self, "top_k", top_k)

        min_p = _real("min_p", self.min_p, "in [0, 1]")
        if not 0 <= min_p <= 1:
            raise _fail("min_p", "in [0, 1]", self.min_p)
        set_(self, "min_p", min_p)

        repetition = _real("repetition_penalty", self.repetition_penalty, "> 0")
        if repetition <= 0:
            raise _fail("repetition_penalty", "> 0", self.repetition_penalty)
        set_(self, "repetition_penalty", repetition)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name), "in [-2, 2]")
            if not -2 <= value <= 2:
                raise _fail(name, "in [-2, 2]", getattr(self, name))
            set_(self, name, value)

        if self.seed is not None:
            set_(self, "seed", _integer("seed", self.seed, "or null"))

        if self.max_tokens is not None:
            max_tokens = _integer("max_tokens", self.max_tokens, ">= 1 (or null)")
            if max_tokens < 1:
                raise _fail("max_tokens", ">= 1 (or null)", self.max_tokens)
            set_(self, "max_tokens", max_tokens)

        min_tokens = _integer("min_tokens", self.min_tokens, ">= 0")
        if min_tokens < 0:
            raise _fail("min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None and min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        set_(self, "min_tokens", min_tokens)

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise _fail("stop", "a non-empty string or a list of non-empty strings", self.stop)
        set_(self, "stop", tuple(stop))

        ids = self.stop_token_ids
        if (isinstance(ids, str) or not isinstance(ids, Sequence)
                or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise _fail("stop_token_ids", "a list of integers >= 0", ids)
        set_(self, "stop_token_ids", tuple(int(i) for i in ids))

        if not isinstance(self.ignore_eos, bool):
            raise _fail("ignore_eos", "true or false", self.ignore_eos)

        if self.logprobs is not None:
            logprobs = _integer("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}] (or null)")
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise _fail("logprobs", f"in [0, {MAX_LOGPROBS}] (or null)", self.logprobs)
            set_(self, "logprobs", logprobs)

        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise _fail("structured", "a StructuredOutput (or null)", self.structured)

        set_(self, "logit_bias", _logit_bias(self.logit_bias))

        if self.prompt_logprobs is not None:
            prompt_logprobs = _integer("prompt_logprobs", self.prompt_logprobs, f"in [0, {MAX_LOGPROBS}] (or null)")
            if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
                raise _fail("prompt_logprobs", f"in [0, {MAX_LOGPROBS}] (or null)", self.prompt_logprobs)
            set_(self, "prompt_logprobs", prompt_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
