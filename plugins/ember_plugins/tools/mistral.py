"""Mistral tool calls (v3 tokenizers, Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo):

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

`[TOOL_CALLS]` is a special token, which decoded output usually no longer holds: an answer that starts with a
JSON array of call objects is read as calls too.
"""

from __future__ import annotations

from collections.abc import Sequence

from ember_platform.api import (
    MAX_PARALLEL_CALLS,
    CallSegment,
    Segment,
    TextSegment,
    Tool,
    ToolParser,
    call_schema,
    json_rule,
    partial_marker,
    scan_json_call,
)

MARKER = "[TOOL_CALLS]"
_WHITESPACE = " \t\n\r"


def _array_start(text: str, pos: int, *, final: bool) -> int | bool | None:
    """Index of the first call object in the array at text[pos:]; False if no array of objects is there; None while
    that cannot be told yet."""
    i = len(text) - len(text[pos:].lstrip(_WHITESPACE))
    if i >= len(text):
        return None if not final else False
    if text[i] != "[":
        return False
    j = len(text) - len(text[i + 1:].lstrip(_WHITESPACE))
    if j >= len(text):
        return None if not final else False
    return j if text[j] == "{" else False


class MistralToolParser(ToolParser):
    name = "mistral"

    @classmethod
    def matches_template(cls, template: str) -> bool:
        return MARKER in template

    def scan(self, text: str, *, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        first = _array_start(text, 0, final=final)  # an answer that is the array: the marker was a skipped token
        if first is None:
            return segments
        marker = -1 if first is not False else text.find(MARKER)
        if marker >= 0:
            segments = [TextSegment(text[:marker])] if marker else []
            first = _array_start(text, marker + len(MARKER), final=final)
        elif first is False:  # plain text, maybe with a marker still arriving at its end
            held = 0 if final else partial_marker(text, MARKER)
            return [TextSegment(text[:len(text) - held])] if text[:len(text) - held] else []
        if first is None:
            return segments
        if first is False:
            rest = text[marker + len(MARKER):]
            return [*segments, TextSegment(MARKER + rest)] if rest or final else segments
        pos = first
        while True:
            call = scan_json_call(text, pos, final=final)
            complete = call.end is not None or final
            if call.name is None:
                if complete:
                    segments.append(TextSegment(text[pos:]))
                return segments
            segments.append(CallSegment(call.name, call.arguments, complete))
            if call.end is None:
                return segments
            rest = text[call.end:].lstrip(_WHITESPACE)
            after = call.end + len(text[call.end:]) - len(rest)
            if rest.startswith(","):
                pos = after + 1
                if not rest[1:].strip(_WHITESPACE):
                    return segments
                continue
            if rest.startswith("]"):
                tail = text[after + 1:]
                if tail and (final or tail.strip(_WHITESPACE)):
                    segments.append(TextSegment(tail))
                return segments
            if rest or final:
                segments.append(TextSegment(text[call.end:]))
            return segments

    def grammar(self, tools: Sequence[Tool], *, parallel: bool, free_text: bool = False) -> str:
        if free_text:  # text, or [TOOL_CALLS] and an array: the marker is a special token, see below
            raise NotImplementedError("strict tools with tool_choice 'auto'")
        # No [TOOL_CALLS]: it is a special token, which a grammar can name only by the tokenizer's id for it; the
        # parser reads an array of calls without it.
        more = f' (", " call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return (f'start: "[" call{more} "]"\n'
                f"call: {json_rule(call_schema(tools))}\n")
