"""Read a JSON tool-call object (`{"name": ..., "arguments": {...}}`) that may be unfinished, keeping the arguments'
raw text: most families write their calls so, and a streamed call must be read before its object closes."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_LITERAL = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


@dataclass(frozen=True, slots=True)
class JsonCall:
    """What `scan_json_call` read. `end`: the index after the closing brace, or None while the object is open."""

    name: str | None
    arguments: str
    end: int | None
    is_object: bool  # the text starts with "{" (a parser may then wait for the name)


def _skip(text: str, i: int) -> int:
    match = _WHITESPACE.match(text, i)
    return match.end() if match else i


def _string_end(text: str, i: int) -> tuple[str, int] | None:
    """The JSON string starting at text[i] (a quote) and the index after it, or None while it is unfinished."""
    try:
        return json.decoder.scanstring(text, i + 1)
    except json.JSONDecodeError:
        return None


def value_end(text: str, i: int, *, final: bool) -> int | None:
    """The index after the JSON value starting at text[i], or None while it is unfinished (or malformed)."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        found = _string_end(text, i)
        return found[1] if found else None
    if first in "{[":
        depth, in_string, escaped = 0, False, False
        for j in range(i, len(text)):
            char = text[j]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    match = _LITERAL.match(text, i)
    if match is None or (match.end() == len(text) and not final):  # a number may go on
        return None
    return match.end()


def scan_json_call(text: str, start: int = 0, *, argument_keys: Sequence[str] = ("arguments",),
                   final: bool = False) -> JsonCall:
    """Read the call object at text[start:] (after whitespace) as far as it is written.

    `name` is the "name" member once its string is complete; `arguments` the raw text of the first member named in
    `argument_keys` (so far, while unfinished; a JSON string there is a call whose arguments were encoded as text,
    and counts once complete, decoded). Members are read in any order; a malformed object stops the reading.
    """
    i = _skip(text, start)
    if i >= len(text) or text[i] != "{":
        return JsonCall(None, "", None, False)
    name: str | None = None
    arguments = ""
    i += 1
    while True:
        i = _skip(text, i)
        if i >= len(text):
            return JsonCall(name, arguments, None, True)
        if text[i] == "}":
            return JsonCall(name, arguments, i + 1, True)
        if text[i] == ",":
            i = _skip(text, i + 1)
        key_found = _string_end(text, i) if i < len(text) and text[i] == '"' else None
        if key_found is None:
            return JsonCall(name, arguments, None, True)
        key, i = key_found
        i = _skip(text, i)
        if i >= len(text) or text[i] != ":":
            return JsonCall(name, arguments, None, True)
        i = _skip(text, i + 1)
        end = value_end(text, i, final=final)
        if key == "name":
            found = _string_end(text, i) if i < len(text) and text[i] == '"' else None
            if found is None:
                return JsonCall(name, arguments, None, True)
            name = found[0]
        elif key in argument_keys and not arguments:
            if i < len(text) and text[i] in "{[":
                arguments = text[i:end] if end is not None else text[i:].rstrip()
            elif end is not None:
                raw = text[i:end]
                arguments = json.loads(raw) if raw.startswith('"') else raw
        if end is None:
            return JsonCall(name, arguments, None, True)
        i = end
