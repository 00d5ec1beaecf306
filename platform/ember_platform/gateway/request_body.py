"""A request body turned into JSON without trusting it: its size, nesting depth and strings are checked before
anything else reads it, so a hostile body is a 4xx naming what is wrong, never a 500 (RecursionError from
`json.loads`, UnicodeEncodeError from a lone surrogate). Used by the gateway and, through protocol.py, the replica."""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from ember.errors import EmberError
from ember_platform.gateway.errors import ProtocolError, invalid_json, invalid_request

MAX_BODY_BYTES_ENV = "EMBER_MAX_BODY_BYTES"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Deeper than any real request (tool schemas nest a few levels) and far below where json.loads recurses out.
MAX_JSON_DEPTH = 64
# Arrays, objects and array items / object members in one body: json.loads holds the GIL (and so the event loop)
# for the whole parse, ~0.2 s per million values; 2^19 is twice 128 prompts of 2048 token ids.
MAX_JSON_VALUES = 1 << 19

_STRING_LITERAL = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_NOT_STRUCTURE = bytes(set(range(256)) - set(b"[]{},"))
_OBJECTS_AS_ARRAYS = bytes.maketrans(b"{}", b"[]")
# A lone surrogate comes from a \uD800-\uDFFF escape, or from its UTF-8-style bytes (ED A0-BF ..), which json.loads
# decodes with "surrogatepass" instead of refusing them.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def max_body_bytes() -> int:
    """The largest request body accepted: $EMBER_MAX_BODY_BYTES, else 32 MiB."""
    value = os.environ.get(MAX_BODY_BYTES_ENV)
    if not value:
        return DEFAULT_MAX_BODY_BYTES
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit < 1:
        raise EmberError(f"{MAX_BODY_BYTES_ENV}={value!r}: expected a positive number of bytes")
    return limit


def body_too_large(limit: int) -> ProtocolError:
    return ProtocolError(413, f"The request body is larger than this server accepts ({limit} bytes; "
                              f"{MAX_BODY_BYTES_ENV} sets the limit). Send a shorter prompt.", None,
                         "request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` (from Content-Length, else while read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth_exceeds(body: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests arrays/objects deeper than `limit`, found with C-speed byte operations only.

    Strings are cut out first (brackets inside them do not nest); each pass then removes the innermost `[]` pairs,
    so the number of passes is the depth. Malformed nesting stops the count: json.loads reports it better."""
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _STRING_LITERAL.sub(b"", raw).translate(_OBJECTS_AS_ARRAYS, _NOT_BRACKETS)
    for _ in range(limit):
        if len(brackets) // 2 <= limit - _:  # too few pairs left to go deeper than the limit
            return False
        peeled = brackets.replace(b"[]", b"")
        if peeled == brackets:
            return False
        brackets = peeled
    return bool(brackets)


def _too_many_values(raw: bytes, limit: int) -> bool:
    """Whether the JSON text holds more than `limit` arrays, objects and items (commas and openers outside
    strings), counted without parsing it."""
    if raw.count(b",") + raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    structure = _STRING_LITERAL.sub(b"", raw).translate(None, _NOT_STRUCTURE)
    return structure.count(b",") + structure.count(b"[") + structure.count(b"{") > limit


def loads(body: bytes | str) -> Any:
    """json.loads, after limits on nesting and size that keep it quick and far from recursion; every failure a 400
    `invalid_json`."""
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    if _too_many_values(raw, MAX_JSON_VALUES):
        raise ProtocolError(413, f"The request body holds more than {MAX_JSON_VALUES} JSON arrays, objects and "
                                 "values. Send fewer or shorter prompts per request.", None, "request_too_large")
    if json_depth_exceeds(raw):
        raise invalid_json(f"arrays and objects nest deeper than {MAX_JSON_DEPTH} levels")
    not_finite: list[str] = []  # json.loads calls these only for float literals and NaN/Infinity: rare, and cheap

    def parse_float(text: str) -> float:
        if not math.isfinite(value := float(text)):
            not_finite.append(text)
        return value

    def parse_constant(text: str) -> float:
        not_finite.append(text)
        return float(text)

    try:
        data = json.loads(body, parse_float=parse_float, parse_constant=parse_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid_json(str(e)) from None
    except RecursionError:  # cannot happen below the depth limit; kept so that nothing here is ever a 500
        raise invalid_json(f"arrays and objects nest deeper than {MAX_JSON_DEPTH} levels") from None
    if not_finite:
        check_finite(data)
    return data


def first_path(value: Any, bad: Callable[[Any], bool], path: str = "", *, keys: bool = False) -> str | None:
    """The OpenAI-style path (`messages[0].content`, `stop[1]`) of the first value in a decoded body for which `bad`
    holds (object keys too, with `keys`), or None. `path` is where `value` sits."""
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if keys and bad(key):
                return here
            if (found := first_path(item, bad, here, keys=keys)) is not None:
                return found
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            if (found := first_path(item, bad, f"{path}[{i}]", keys=keys)) is not None:
                return found
        return None
    return (path or None) if bad(value) else None


def _lone_surrogate(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path of the first string, or object key, holding a lone UTF-16 surrogate (valid in JSON escapes, not in
    Unicode text), or None."""
    return first_path(value, _lone_surrogate, path, keys=True)


def check_text(data: Any, raw: bytes | str | None = None) -> None:
    """400 naming the first field whose text is not valid Unicode. With the `raw` body, skipped at once when it
    holds no surrogate escape (the common case: no walk over a large body)."""
    if raw is not None:
        scanned = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
        if (b"\\u" not in scanned and b"\xed" not in scanned) or not _SURROGATE.search(scanned):  # `in`: faster
            return
    path = lone_surrogate_path(data)
    if path is not None:
        path = _printable(path)
        raise invalid_request(path, f"Invalid '{path}': the text contains a lone UTF-16 surrogate (an unpaired "
                                    "\\ud800-\\udfff escape), which is not valid Unicode.", "invalid_unicode")


def non_finite_path(value: Any, path: str = "") -> str | None:
    """The OpenAI-style path of the first number that is not finite (1e999, NaN), or None."""
    return first_path(value, lambda v: isinstance(v, float) and not math.isfinite(v), path)


def check_finite(data: Any) -> None:
    """400 naming the first number that is not finite: JSON has no infinities, so such a body could not be encoded
    again (by a request hook, an error, a log line), and no field takes one. `loads` checks what it decodes (at the
    cost of a walk only when the body held such a number)."""
    if (path := non_finite_path(data)) is not None:
        path = _printable(path)
        raise invalid_request(path, f"Invalid '{path}': numbers must be finite (JSON has no infinity or NaN).",
                              "invalid_value")


def _printable(path: str) -> str:
    # A path through an object key with a lone surrogate: shown escaped, so that the error itself can be encoded.
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id(sent: str | None) -> str:
    """The client's X-Request-Id when it is a short plain token, else a fresh one: the id is logged, echoed in
    error bodies and forwarded as a header, where bytes outside ASCII or a kilobyte of them would fail."""
    return sent if sent and _REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex
