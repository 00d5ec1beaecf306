"""The tools a request offers, how it lets the model use them, and the calls a model makes."""

from __future__ import annotations

import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 24  # OpenAI's ids are "call_" and 24 letters or digits


def new_tool_call_id() -> str:
    """A fresh id for one tool call, shaped like OpenAI's: `call_` + 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))


@dataclass(frozen=True, slots=True)
class Tool:
    """One function a request offers the model. `parameters` is the JSON schema its arguments follow."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    strict: bool = False  # OpenAI's `strict`: the arguments must follow `parameters`, even in "auto" mode

    def arguments_schema(self) -> dict[str, Any]:
        """The schema the arguments follow: `parameters`; without them (as OpenAI defines it) no parameters at all."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return dict(self.parameters)


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How a request lets the model use its tools.

    `mode`: "auto" (the model may call any, its output is parsed), "required" (it must call one or more, which a
    grammar enforces) or "named" (it must call `tools[0]`, the one named; the others are not offered).
    `parallel`: False allows one call only (`parallel_tool_calls: false`).
    """

    tools: tuple[Tool, ...]
    mode: Literal["auto", "required", "named"] = "auto"
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """Whether the output is forced to be calls (nothing else)."""
        return self.mode != "auto"

    @property
    def strict(self) -> bool:
        """Whether the calls the model writes must follow their schemas: a strict tool among them. In "auto"
        mode every call is then constrained (a non-strict tool's to its schema too, which it allows)."""
        return any(tool.strict for tool in self.tools)


@dataclass(slots=True)
class ToolCall:
    """One call the model made: `arguments` is JSON text, exactly as the model wrote it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
