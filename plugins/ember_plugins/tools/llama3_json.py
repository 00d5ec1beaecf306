"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is the call(s), optionally after `<|python_tag|>`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

several separated by "; ". (`<|python_tag|>` is a special token: decoded output usually no longer holds it.)
"""

from __future__ import annotations

from collections.abc import Sequence

from ember_platform.api import (
    CallSegment,
    Segment,
    TextSegment,
    Tool,
    ToolParser,
    call_schema,
    json_rule,
    repeated,
    scan_json_call,
)

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "
ARGUMENT_KEYS = ("parameters", "arguments")  # Llama writes "parameters"; fine-tunes often "arguments"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    @classmethod
    def matches_template(cls, template: str) -> bool:
        # Llama 3.1's template asks for {"name": ..., "parameters": ...} and names <|python_tag|> for built-ins.
        return PYTHON_TAG in template or ('"parameters"' in template and "<|eot_id|>" in template)

    def scan(self, text: str, *, final: bool) -> list[Segment]:
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            start += len(PYTHON_TAG)
        elif not stripped.startswith("{"):
            if not final and PYTHON_TAG.startswith(stripped):  # nothing yet, or a tag still arriving
                return []
            return [TextSegment(text)] if text else []
        segments: list[Segment] = []
        pos = start
        while True:
            call = scan_json_call(text, pos, argument_keys=ARGUMENT_KEYS, final=final)
            complete = call.end is not None or final
            if call.name is None:
                if complete:  # JSON, but no call: the model answered with an object
                    segments.append(TextSegment(text[pos:] if segments else text))
                return segments
            segments.append(CallSegment(call.name, call.arguments, complete))
            if call.end is None:
                return segments
            rest = text[call.end:]
            after = rest.lstrip(" \t\n\r")
            if after.startswith(";") and (after[1:].lstrip().startswith("{") or not final):
                pos = call.end + (len(rest) - len(after)) + 1
                if not after[1:].strip():
                    return segments  # a separator, the next call still to come
                continue
            if rest and (final or after):
                segments.append(TextSegment(rest))
            return segments

    def grammar(self, tools: Sequence[Tool], *, parallel: bool, free_text: bool = False) -> str:
        calls = repeated("call", SEPARATOR, parallel=parallel)
        call = f"call: {json_rule(call_schema(tools, arguments_key='parameters'))}\n"
        if not free_text:
            return f"start: {calls}\n{call}"
        # The answer is text or calls; text then must not start with "{", which would begin a call.
        return f"start: PLAIN | {calls}\nPLAIN: /(.|\\n)*/ & ~/[ \\t\\r\\n]*\\{{(.|\\n)*/\n{call}"
