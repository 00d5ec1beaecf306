"""Hermes-style tool calls, as Qwen2.5 and NousResearch's Hermes models write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, after optional text.
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
    lark_string,
    partial_marker,
    repeated,
    scan_json_call,
    text_up_to,
    text_without,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    @classmethod
    def matches_template(cls, template: str) -> bool:
        return OPEN in template

    def scan(self, text: str, *, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                rest = text[pos:]
                if not final or segments:  # after a call, an unfinished "<tool_c" is markup cut off (max_tokens)
                    rest = rest[:len(rest) - partial_marker(rest, OPEN)]
                if rest:
                    segments.append(TextSegment(rest))
                return segments
            if start > pos:
                segments.append(TextSegment(text[pos:start]))
            body_start = start + len(OPEN)
            end = text.find(CLOSE, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            if end < 0 and not final:
                body = body[:len(body) - partial_marker(body, CLOSE)]
            complete = end >= 0 or final
            call = scan_json_call(body, final=complete)
            if call.name is None and complete:  # markup around no readable call: the model's text after all
                segments.append(TextSegment(text[start:] if end < 0 else text[start:end + len(CLOSE)]))
            else:
                segments.append(CallSegment(call.name, call.arguments, complete))
            if end < 0:
                return segments
            pos = end + len(CLOSE)

    def grammar(self, tools: Sequence[Tool], *, parallel: bool, free_text: bool = False) -> str:
        call = f"{lark_string(OPEN + chr(10))} call_json {lark_string(chr(10) + CLOSE)}"
        json_call = f"call_json: {json_rule(call_schema(tools))}\n"
        if not free_text:
            return f"start: {repeated('call', chr(10), parallel=parallel)}\ncall: {call}\n{json_call}"
        # Text that never opens a call, or text up to the first call's opening (lazy: it ends there) and the calls.
        first = f"call_json {lark_string(chr(10) + CLOSE)}"
        more = f" ({lark_string(chr(10))} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
        return (f"start: PLAIN | lead first{more}\n"
                f"PLAIN: {text_without(OPEN)}\n"
                f"lead[lazy]: {text_up_to(OPEN + chr(10))}\n"
                f"first: {first}\n"
                f"call: {call}\n{json_call}")
