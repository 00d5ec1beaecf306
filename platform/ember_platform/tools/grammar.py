"""Pieces of the grammars that force tool calls: the JSON schema of one call object, and Lark helpers.

The grammars are Lark in llguidance's dialect, where `%json {schema}` is a rule matching JSON valid against the
schema. The JSON is written compactly with one space after ":" and ",", as models of every family write their
calls: free whitespace would let a model wander off into spaces and newlines where it never saw any.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .calls import Tool

# Most calls one constrained output may hold with parallel calls on: without a bound a model that repeats itself
# (small ones do) would write calls until max_tokens cut the last one off, and it would not parse.
MAX_PARALLEL_CALLS = 8
COMPACT_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def call_schema(tools: Sequence[Tool], *, name_key: str = "name", arguments_key: str = "arguments") -> dict[str, Any]:
    """The schema of one call object, `{"name": NAME, "arguments": {...}}` in that order, to any of `tools`."""
    options = [{
        "type": "object",
        "properties": {name_key: {"const": tool.name}, arguments_key: tool.arguments_schema()},
        "required": [name_key, arguments_key],
        "additionalProperties": False,
    } for tool in tools]
    if not options:
        raise ValueError("a tool-call grammar needs at least one tool")
    return options[0] if len(options) == 1 else {"anyOf": options}


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule body matching compact JSON valid against `schema`."""
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON}, ensure_ascii=False)


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def text_without(marker: str) -> str:
    """A Lark regex body matching any text that never writes `marker`."""
    return f"/(.|\\n)*/ & ~/(.|\\n)*{_regex_literal(marker)}(.|\\n)*/"


def text_up_to(marker: str) -> str:
    """A Lark regex body matching any text that ends with the first `marker` it writes (use in a `[lazy]` rule)."""
    return f"/(.|\\n)*{_regex_literal(marker)}/"


def _regex_literal(text: str) -> str:
    return "".join(f"\\{c}" if c in "\\.^$|?*+()[]{}/" else ("\\n" if c == "\n" else c) for c in text)


def repeated(rule: str, separator: str, *, parallel: bool) -> str:
    """Lark for one `rule`, or (parallel) one to MAX_PARALLEL_CALLS of them separated by the literal `separator`."""
    if not parallel:
        return rule
    return f"{rule} ({lark_string(separator)} {rule}){{0,{MAX_PARALLEL_CALLS - 1}}}"
