"""The tool-parser contract (`ember_tool_parsers` registers implementations) and the non-streaming parse.

A parser knows one family's call format. It implements one method for reading, `scan`, which splits output text
into text and calls; both the whole-output parse and the streamed deltas (`ToolCallStream`) are built on it, so a
streamed response reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from .calls import Tool, ToolCall

NO_ARGUMENTS = "{}"  # what a call that never wrote its arguments gets: OpenAI's arguments are always JSON text


@dataclass(frozen=True, slots=True)
class TextSegment:
    """Output text that is not a tool call (the message's content)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallSegment:
    """One tool call as far as it is written.

    `name`: None until the function's name is complete. `arguments`: the raw JSON text of the arguments so far (""
    until they begin). `complete`: the call's markup is closed (or the output ended).
    """

    name: str | None
    arguments: str = ""
    complete: bool = False


Segment = TextSegment | CallSegment


class ToolParser:
    """Reads one model family's tool calls from its output text, and writes the grammar that forces them.

    Subclass it, set `name`, implement `scan` and `grammar`, and register the class with `ember_tool_parsers`.
    One instance serves every request of a replica: keep no per-request state (the stream has its own).
    """

    name: ClassVar[str] = ""

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Whether a chat template writes this family's call format, so a package whose manifest names no parser
        gets this one (when exactly one parser matches)."""
        return False

    def scan(self, text: str, *, final: bool) -> list[Segment]:
        """Split output text into text and calls, in order.

        With `final` False the output may go on: leave out text that may still turn into markup (an unfinished
        "<tool_c"), and report an unfinished call with what is known of it. As text grows, the segments returned
        before must stay as they were (only the last may grow), since what was streamed cannot be taken back.
        With `final` True, markup that holds no readable call is returned as text.
        """
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool], *, parallel: bool, free_text: bool = False) -> str:
        """A Lark grammar (llguidance syntax, `%json {...}` for the arguments) whose every string is one or more
        calls (one when not `parallel`) in this family's format, to one of `tools`, arguments valid against that
        tool's parameters schema; nothing else (no text before or after).

        `free_text`: the grammar of `tool_choice` "auto" with `strict` tools instead: any text the format allows
        (calls optional, text wherever the format has it) but every call written is one of those. A parser that
        cannot write it raises NotImplementedError (the request is then refused, naming `strict`).
        """
        raise NotImplementedError


def content_pieces(segments: Sequence[Segment], *, final: bool) -> list[str | CallSegment]:
    """The segments as the message shows them: whitespace that only separates text from calls dropped.

    Not final, the trailing whitespace of the last text is held back too: it may yet precede a call.
    """
    named = [s for s in segments if not isinstance(s, CallSegment) or s.name is not None or not final]
    pieces: list[str | CallSegment] = []
    for i, segment in enumerate(named):
        if isinstance(segment, CallSegment):
            pieces.append(segment)
            continue
        text = segment.text
        if i > 0 and isinstance(named[i - 1], CallSegment):
            text = text.lstrip()
        if (i + 1 < len(named) and isinstance(named[i + 1], CallSegment)) or (not final and i == len(named) - 1):
            text = text.rstrip()
        pieces.append(text)
    return pieces


def call_arguments(call: CallSegment) -> str:
    """The arguments a call reports: its JSON text, or "{}" for a finished call that wrote none."""
    return call.arguments or (NO_ARGUMENTS if call.complete else "")


def parse_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output as (content, tool calls): content None when there is only whitespace besides the calls."""
    pieces = content_pieces(parser.scan(text, final=True), final=True)
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [ToolCall(p.name, call_arguments(p)) for p in pieces if isinstance(p, CallSegment) and p.name]
    if calls and not content.strip():
        return None, calls
    return content, calls


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (without being all of it): text a streaming
    parser holds back, since the next piece may complete the marker."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class FirstCallOnly(ToolParser):
    """`parser`, reading no further than its first call: `parallel_tool_calls: false` in `auto` mode, where nothing
    stops the model from writing more (what it writes after that call is neither content nor a call)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.name = parser.name  # type: ignore[misc]  # the instance's, for logs

    def scan(self, text: str, *, final: bool) -> list[Segment]:
        segments = self.parser.scan(text, final=final)
        for index, segment in enumerate(segments):
            if isinstance(segment, CallSegment):
                return segments[:index + 1]
        return segments

    def grammar(self, tools: Sequence[Tool], *, parallel: bool, free_text: bool = False) -> str:
        return self.parser.grammar(tools, parallel=False, free_text=free_text)
