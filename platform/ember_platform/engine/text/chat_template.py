"""Chat templates: render a model's Jinja template into a prompt exactly as transformers does.

Templates come from model repositories, so they are untrusted code: they run in Jinja's immutable sandbox.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning arrives under; templates (Qwen3, DeepSeek) read the first, gpt-oss reads
# `thinking`. transformers fills both from whichever is present, so the same messages render the same here.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rendered for these messages (the HTTP layer answers 400)."""


class _TemplateRaisedError(jinja2.TemplateError):
    """Raised by the template's own `raise_exception(...)`: its message is meant for the user as is."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaisedError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own `tojson` HTML-escapes `<`, `>` and `&` and takes only `indent`; templates are written
    # against transformers' filter, which emits plain JSON, so tool schemas reach the model unescaped.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    # `dict` for templates without handing them the type itself (whose attributes lead to CPython internals).
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Jinja's namespace accepts any attribute name; underscore names are how sandbox escapes begin.
    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Namespace: `namespace(self=1)`
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template: every request of a model renders the same one."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} (template line {e.lineno})") from e


def _plain(value: Any) -> Any:
    # Templates see plain JSON-like data only: objects with methods (pydantic models, enums, str subclasses)
    # would widen what sandboxed code can call, and pydantic messages from the HTTP layer become dicts here.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to templates: plain dicts, None-valued keys dropped.

    OpenAI clients send `content: null` beside `tool_calls`; many templates print a literal "None" for a
    present-but-None key while they handle a missing one, so the key goes.
    """
    normalized = []
    for index, message in enumerate(messages):
        message = _plain(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {index} must be an object with 'role' and 'content', got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def render_chat_template(template: str, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                         tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> str:
    """Render `messages` (and `tools`, and any extra template variables such as `bos_token`) to a prompt.

    Raises ChatTemplateError with the template's own message when it rejects the conversation
    (e.g. "Conversation roles must alternate user/assistant/user/assistant/...").
    """
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation: send at least one message")
    if tools is not None:
        for index, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(f"tool {index} must be a JSON schema object, got {type(tool).__name__}")
    compiled = compile_chat_template(template)
    try:
        return compiled.render(messages=normalize_messages(messages), tools=_plain(tools),
                               add_generation_prompt=add_generation_prompt, **_plain(variables))
    except _TemplateRaisedError as e:
        raise ChatTemplateError(e.message or "the chat template rejected the conversation") from e
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed to render: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        # Template code indexing a missing field or adding str to list fails with a Python error; it is still
        # a property of this conversation and template, not a server fault.
        raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from e
