"""OpenAI's /v1/chat/completions and /v1/completions request bodies: parsed, checked, mapped to SamplingParams.

Use `parse_chat_request` / `parse_completion_request`: every problem becomes a `ProtocolError` whose `param` names
the offending field as OpenAI writes it (`top_p`, `messages[0].role`, `messages[1].content[0].type`).

Types are strict (a number sent as a string is a 400, as at OpenAI). Ranges are checked once, by SamplingParams;
the models here only add OpenAI's own limits (n, stop, logprobs) and refuse what Ember does not serve.
Unknown fields are accepted and have no effect, as in vLLM, so clients that send newer OpenAI parameters keep
working; `ignored_fields` lists them for the gateway to log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from ember.errors import EmberError
from ember_platform.engine.sampling_params import SamplingParams, SamplingParamsError
from ember_platform.gateway import request_body
from ember_platform.gateway.choices import MAX_CHOICES
from ember_platform.gateway.errors import (
    ProtocolError,
    context_length_exceeded,
    invalid_json,
    invalid_request,
    unsupported,
)
from ember_platform.gateway.request_body import check_text
from ember_platform.gateway.structured_outputs import ConstraintFields
from ember_platform.tools.calls import Tool, ToolUse

MAX_STOP_SEQUENCES = 4
MAX_PROMPTS_ENV = "EMBER_MAX_PROMPTS"
# Prompts in one /v1/completions request: each becomes an engine request, so one body must not fan out without
# bound. $EMBER_MAX_PROMPTS sets it (read at start-up: replicas inherit the gateway's environment).
MAX_PROMPTS_DEFAULT = 128


def _max_prompts() -> int:
    value = os.environ.get(MAX_PROMPTS_ENV) or str(MAX_PROMPTS_DEFAULT)
    if not value.isdigit() or int(value) < 1:
        raise EmberError(f"{MAX_PROMPTS_ENV}={value!r}: expected a positive number of prompts")
    return int(value)


MAX_PROMPTS = _max_prompts()
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# OpenAI's (and vLLM's) default for /v1/completions when the body has no max_tokens; chat has none.
COMPLETION_DEFAULT_MAX_TOKENS = 16

_CONFIG = ConfigDict(strict=True, extra="allow", protected_namespaces=())

# Tags of the str-or-list unions below. A callable discriminator picks one branch from the value's shape, so an
# error reports only that branch; the tags are dropped again from the error's path (see `_param_path`).
_STRING, _LIST, _OBJECT, _TOKENS, _TOKEN_LISTS = "<string>", "<list>", "<object>", "<tokens>", "<token-lists>"
_UNION_TAGS = frozenset({_STRING, _LIST, _OBJECT, _TOKENS, _TOKEN_LISTS})


def _shape(value: Any) -> str | None:
    if isinstance(value, str):
        return _STRING
    if isinstance(value, list):
        return _LIST
    return _OBJECT if isinstance(value, dict) else None


def _prompt_shape(value: Any) -> str | None:
    if isinstance(value, str):
        return _STRING
    if not isinstance(value, list):
        return None
    if value and isinstance(value[0], list):
        return _TOKEN_LISTS
    if value and not isinstance(value[0], str):
        return _TOKENS
    return _LIST


def _one_of(shape: Any, description: str) -> Discriminator:
    return Discriminator(shape, custom_error_type="invalid_type", custom_error_message=f"Input should be {description}")


TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Stop = Annotated[
    Annotated[str, Tag(_STRING)] | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES), Tag(_LIST)],
    _one_of(_shape, f"a string or a list of at most {MAX_STOP_SEQUENCES} strings"),
]
Prompt = Annotated[
    Annotated[str, Tag(_STRING)]
    | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS), Tag(_LIST)]
    | Annotated[TokenIds, Tag(_TOKENS)]
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS), Tag(_TOKEN_LISTS)],
    _one_of(_prompt_shape, "a string, a list of strings, a list of token ids or a list of token-id lists"),
]


class TextContentPart(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]  # images, audio and files: Ember serves text models only
    text: str


MessageContent = Annotated[
    Annotated[str, Tag(_STRING)] | Annotated[list[TextContentPart], Tag(_LIST)],
    _one_of(_shape, "a string or a list of content parts"),
]


class ChatMessage(BaseModel):
    """One message; fields other than role and content (name, tool_calls, tool_call_id, ...) reach the template."""

    model_config = _CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent | None = Field(default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_required(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")  # absent when the role itself was invalid: that error is reported instead
        if content is None and role is not None and role != "assistant":
            raise PydanticCustomError("missing", "Field required")
        return content

    def text(self) -> str:
        """The content as one string: text parts joined by newlines, as vLLM does for string-only templates."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def template_message(self) -> dict[str, Any]:
        # Open models' templates know "system", not OpenAI's newer "developer" (which replaces it).
        role = "system" if self.role == "developer" else self.role
        message = {**(self.model_extra or {}), "role": role, "content": self.text()}
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_template_tool_call(call) for call in message["tool_calls"]]
        return message


def _template_tool_call(call: Any) -> Any:
    """An assistant message's tool call as templates take it: OpenAI sends the arguments as JSON text, templates
    (Qwen2.5's, Llama 3.1's) write them with `| tojson`, which would quote that text again; so, as transformers'
    callers do, they get the object."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": decoded}} if isinstance(decoded, dict) else call


class FunctionDefinition(BaseModel):
    model_config = _CONFIG
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _CONFIG
    name: str


class NamedToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag(_STRING)] | Annotated[NamedToolChoice, Tag(_OBJECT)],
    _one_of(_shape, "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"),
]


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool | None = None


def parse_model_name(model: str) -> tuple[str, str | None]:
    """`"NAME"` -> (NAME, None); `"NAME:ADAPTER"` -> (NAME, ADAPTER), a LoRA adapter of that model."""
    name, colon, adapter = model.partition(":")
    if not name or (colon and not adapter):
        raise invalid_request("model", f"Invalid 'model': {model!r}. Use 'NAME' or 'NAME:ADAPTER' (a LoRA adapter).")
    return name, adapter or None


class GenerationRequest(ConstraintFields):
    """What both endpoints share: the model, sampling settings (OpenAI's and vLLM's extras), streaming, and the
    output constraint (response_format and vLLM's structured_outputs / guided_*: see structured_outputs.py)."""

    model_config = _CONFIG
    _prompt_param: ClassVar[str]

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Stop | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras (the OpenAI client sends them through `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)

    @property
    def model_and_adapter(self) -> tuple[str, str | None]:
        return parse_model_name(self.model)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (and carries `"usage": null` on every other chunk)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def ignored_fields(self) -> list[str]:
        """Top-level fields Ember does not know, accepted without effect."""
        return sorted(self.model_extra or {})

    @property
    def requested_max_tokens(self) -> int | None:
        """The output limit the body asked for, or None for the default."""
        return self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.num_logprobs() is not None

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: top alternatives per token, None when no logprobs were asked for."""
        raise NotImplementedError

    def _default_max_tokens(self, room: int | None) -> int | None:
        return room

    def _openai_param(self, field: str) -> str:
        return field

    @property
    def num_choices(self) -> int:
        """Choices returned per prompt (`n`)."""
        return 1 if self.n is None else self.n

    @property
    def num_candidates(self) -> int:
        """Sequences generated per prompt (`best_of` where the endpoint has it, else `n`)."""
        return self.num_choices

    def token_logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` with its keys (token ids, as strings in JSON) as ints; 400 naming the field otherwise."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                shown = repr(key) if len(key) <= 40 else repr(key[:40] + "...")
                raise invalid_request("logit_bias", f"Invalid 'logit_bias': keys must be token ids (decimal "
                                                    f"integers >= 0), got {shown}.")
            bias[int(key)] = value
        return bias

    def check(self) -> None:
        """Refuse what Ember does not serve and what only makes sense together; validate the sampling settings."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise invalid_request("n", f"Invalid 'n': it must be in [1, {MAX_CHOICES}], got {self.n}.")
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options", "stream_options is only allowed when 'stream' is true.")
        parse_model_name(self.model)
        self.to_sampling_params(None)

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """The engine's settings for this request; `default_max_tokens` applies when the body sets no limit.

        Pass the room left in the context (`sampling_params_for` does). Raises ProtocolError naming the field.
        """
        requested = self.requested_max_tokens
        values: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "seed": self.seed, "min_tokens": self.min_tokens,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "logit_bias": self.token_logit_bias(),
        }
        kwargs = {name: value for name, value in values.items() if value is not None}
        kwargs["max_tokens"] = requested if requested is not None else self._default_max_tokens(default_max_tokens)
        kwargs["logprobs"] = self.num_logprobs()
        constraint = self.output_constraint()
        kwargs["structured"] = constraint.structured if constraint is not None else None
        try:
            return SamplingParams(**kwargs)
        except SamplingParamsError as e:
            param = self._openai_param(e.field)
            message = str(e)
            if param != e.field and message.startswith(e.field):  # say it with the name the client sent
                message = param + message[len(e.field):]
            raise invalid_request(param, f"Invalid '{param}': {message}.") from None

    def sampling_params_for(self, num_prompt_tokens: int, max_model_len: int,
                            vocab_size: int | None = None) -> SamplingParams:
        """`to_sampling_params` once the prompt is tokenized: 400 if prompt plus requested output cannot fit, or
        (given the model's `vocab_size`) if a token id the request names is not in the vocabulary."""
        if vocab_size is not None:
            outside = [i for i in self.stop_token_ids or () if i >= vocab_size]
            if outside:
                raise invalid_request("stop_token_ids", f"Invalid 'stop_token_ids': token ids must be in "
                                                        f"[0, {vocab_size}), got {outside[0]}.")
            biased = [i for i in self.token_logit_bias() or () if i >= vocab_size]
            if biased:
                raise invalid_request("logit_bias", f"Invalid 'logit_bias': token ids must be in [0, {vocab_size}), "
                                                    f"got {biased[0]}.")
        room = max_model_len - num_prompt_tokens
        requested = self.requested_max_tokens
        if room < 1 or (requested is not None and requested > room):
            raise context_length_exceeded(max_model_len, num_prompt_tokens, requested if room >= 1 else None,
                                          param=self._prompt_param)
        return self.to_sampling_params(room)


class ChatCompletionRequest(GenerationRequest):
    """The body of POST /v1/chat/completions."""

    _prompt_param = "messages"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaced max_tokens; OpenAI takes the new name when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _openai_param(self, field: str) -> str:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if field == "logprobs" else field

    def check(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("top_logprobs", "top_logprobs requires 'logprobs' to be true.")
        self._check_tools()
        super().check()

    def _check_tools(self) -> None:
        if self.tools is None or self.tools == []:
            for field in ("tools", "tool_choice", "parallel_tool_calls"):
                if getattr(self, field) is not None and (field != "tools" or self.tools == []):
                    raise invalid_request(field, f"Invalid '{field}': it is only allowed when 'tools' lists at "
                                                 "least one tool.")
            return
        names: set[str] = set()
        for index, tool in enumerate(self.tools):
            function = tool.function
            if not _FUNCTION_NAME.fullmatch(function.name):
                raise invalid_request(f"tools[{index}].function.name", f"Invalid 'tools[{index}].function.name': "
                                      f"{function.name!r} must be 1 to 64 letters, digits, '_' or '-'.")
            if function.name in names:
                raise invalid_request(f"tools[{index}].function.name", f"Invalid 'tools[{index}].function.name': "
                                      f"two tools are named {function.name!r}.")
            names.add(function.name)
            _check_parameters_schema(function.parameters, f"tools[{index}].function.parameters")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid_request("tool_choice.function.name", f"Invalid 'tool_choice.function.name': "
                                  f"{choice.function.name!r} is not among the tools ({', '.join(sorted(names))}).")
        strict = choice in (None, "auto") and any(tool.function.strict for tool in self.tools)
        if (choice == "required" or isinstance(choice, NamedToolChoice) or strict) and (
                constraint := self.output_constraint()) is not None:
            what = "strict tools constrain the calls" if strict else "a required or named call constrains the output"
            raise invalid_request("tool_choice", f"Invalid 'tool_choice': {what}, and this request also constrains "
                                                 f"its output with '{constraint.param}'. Send one of them.")
        if self.logprobs and choice != "none":
            raise unsupported("logprobs", "logprobs are not supported together with tools: the output is read as "
                                          "tool calls, and per-token logprobs would show its markup. Send one or the "
                                          "other (or tool_choice 'none').")

    def tool_use(self) -> ToolUse | None:
        """How the model may use the tools; None when it is offered none (no tools, or tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        tools = tuple(Tool(t.function.name, t.function.description, t.function.parameters, bool(t.function.strict))
                      for t in self.tools)
        parallel = self.parallel_tool_calls is not False
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            named = next(t for t in tools if t.name == choice.function.name)
            return ToolUse((named,), "named", parallel=False)
        return ToolUse(tools, "required" if choice == "required" else "auto", parallel=parallel)

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them: string content, 'developer' as 'system'."""
        return [message.template_message() for message in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tool definitions for the template; none when tool_choice is "none", so the model is not offered them.

        Other tool_choice values are not enforced: the model sees the tools and may or may not call one.
        """
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_unset=True) for tool in self.tools]  # as sent, explicit nulls kept


# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _check_parameters_schema(schema: dict[str, Any] | None, param: str) -> None:
    """A tool's parameters must be a JSON schema (by its metaschema) of an object, as OpenAI requires."""
    if schema is None:
        return
    import jsonschema  # only requests with tools pay for the import

    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        raise invalid_request(param, f"Invalid '{param}': '$schema' must be a URI string, got {dialect!r}.")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise invalid_request(param, f"Invalid '{param}': not a valid JSON schema: {e.message} "
                                     f"(at '{where or '.'}').") from None
    if schema.get("type", "object") != "object":
        raise invalid_request(param, f"Invalid '{param}': the arguments must be an object: the schema's type must "
                                     f"be 'object', got {schema.get('type')!r}.")


class CompletionRequest(GenerationRequest):
    """The body of POST /v1/completions."""

    _prompt_param = "prompt"

    prompt: Prompt
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def scores_prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone (with its logprobs), as lm-evaluation-harness asks to score text.
        The engine samples one token anyway (the prefill's last logits make it free); the response leaves it out."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.scores_prompt_only else self.max_tokens

    @property
    def num_candidates(self) -> int:
        return self.num_choices if self.best_of is None else self.best_of

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        params = super().to_sampling_params(default_max_tokens)
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens get logprobs too
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params

    def candidate_params(self, params: SamplingParams) -> SamplingParams:
        """The engine's settings for each candidate: with best_of > n they must report their tokens' logprobs (which
        pick the best), whether or not the client asked for logprobs."""
        if self.num_candidates > self.num_choices and params.logprobs is None:
            return dataclasses.replace(params, logprobs=0)
        return params

    def _default_max_tokens(self, room: int | None) -> int | None:
        # Absent max_tokens means OpenAI's 16; an explicit null means "up to the context", as in vLLM.
        if "max_tokens" in self.model_fields_set:
            return room
        return COMPLETION_DEFAULT_MAX_TOKENS if room is None else min(COMPLETION_DEFAULT_MAX_TOKENS, room)

    def check(self) -> None:
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion) is not supported by Ember.")
        super().check()
        if self.best_of is not None:
            if not self.num_choices <= self.best_of <= MAX_CHOICES:
                raise invalid_request("best_of", f"Invalid 'best_of': it must be in [n, {MAX_CHOICES}] (n is "
                                                 f"{self.num_choices}), got {self.best_of}.")
            if self.stream and self.best_of > self.num_choices:
                raise invalid_request("best_of", "Invalid 'best_of': best_of greater than n cannot be streamed (the "
                                                 "best candidates are known only at the end). Send stream false.")
        engine_requests = len(self.prompts()) * self.num_candidates
        if engine_requests > MAX_PROMPTS:
            field = "best_of" if self.best_of is not None and self.best_of > self.num_choices else "n"
            raise invalid_request(field, f"Invalid '{field}': {len(self.prompts())} prompt(s) x "
                                         f"{self.num_candidates} sequences each is {engine_requests} sequences, "
                                         f"more than {MAX_PROMPTS} per request ({MAX_PROMPTS_ENV} sets the limit).")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item a text or a list of token ids, one choice per item."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


_Request = TypeVar("_Request", bound=GenerationRequest)


def _param_path(loc: tuple[int | str, ...]) -> str | None:
    path = ""
    for item in loc:
        if item in _UNION_TAGS:
            continue
        path += f"[{item}]" if isinstance(item, int) else (f".{item}" if path else str(item))
    return path or None


def _error_code(error_type: str) -> str:
    if error_type == "missing":
        return "missing_required_parameter"
    if error_type.endswith(("_type", "_parsing")) or error_type == "invalid_type":
        return "invalid_type"
    return "invalid_value"


def _from_validation_error(e: ValidationError) -> ProtocolError:
    first = e.errors(include_url=False)[0]
    param = _param_path(first["loc"])
    code = _error_code(first["type"])
    if code == "missing_required_parameter":
        message = f"Missing required parameter: '{param}'."
    else:
        value = first.get("input")
        shown = repr(value) if isinstance(value, str | int | float | bool) or value is None else ""
        got = f" (got {shown})" if shown and len(shown) <= 80 else ""
        message = f"Invalid '{param}': {first['msg']}{got}."
    if (more := e.error_count() - 1) > 0:
        message += f" ({more} more problem{'s' if more > 1 else ''} in the request.)"
    return ProtocolError(400, message, param, code)


def _load(body: bytes | str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(body, Mapping):
        check_text(body)  # decoded by the caller: every string is walked
        return body
    if not body:
        raise invalid_json("the body is empty")
    data = request_body.loads(body)  # a nesting limit first, then json.loads
    check_text(data, body)
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(data), "a number")
        raise invalid_request(None, f"The request body must be a JSON object, got {kind}.", "invalid_type")
    return data


def _parse(cls: type[_Request], body: bytes | str | Mapping[str, Any]) -> _Request:
    data = _load(body)
    try:
        request = cls.model_validate(data)
    except ValidationError as e:
        raise _from_validation_error(e) from None
    request.check()
    return request


def parse_chat_request(body: bytes | str | Mapping[str, Any]) -> ChatCompletionRequest:
    """Parse and check a /v1/chat/completions body (raw JSON or already decoded); raises ProtocolError."""
    return _parse(ChatCompletionRequest, body)


def parse_completion_request(body: bytes | str | Mapping[str, Any]) -> CompletionRequest:
    """Parse and check a /v1/completions body (raw JSON or already decoded); raises ProtocolError."""
    return _parse(CompletionRequest, body)
