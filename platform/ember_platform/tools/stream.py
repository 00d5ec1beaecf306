"""Streamed tool calls: one request's text in, OpenAI's `delta` contents out (text, and tool-call fragments).

Each piece re-scans the text so far (`ToolParser.scan`) and sends what it adds to what was sent: the content's
new characters, a call's opening delta once its name is complete (index, id, type, name, arguments ""), then its
arguments as they grow. So a client that joins the deltas gets the non-streamed response's content and calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .calls import new_tool_call_id
from .parser import CallSegment, ToolParser, call_arguments, content_pieces


@dataclass(slots=True)
class _SentCall:
    id: str
    arguments: str = ""


@dataclass(slots=True)
class ToolCallStream:
    """The tool-call view of one streamed choice. `feed` each piece of text, `finish` once at the end.

    Both return deltas in output order: `{"content": "..."}` or `{"tool_calls": [{...}]}`, each one chunk's delta.
    """

    parser: ToolParser
    _text: str = ""
    _content_sent: int = 0
    _calls: list[_SentCall] = field(default_factory=list)

    @property
    def made_calls(self) -> bool:
        """Whether a call was streamed: the choice then finishes with "tool_calls"."""
        return bool(self._calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        return self._deltas(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(final=True)

    def _deltas(self, *, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        offset = 0  # where the next text piece starts in the content
        index = 0  # the next call's index
        for piece in content_pieces(self.parser.scan(self._text, final=final), final=final):
            if isinstance(piece, str):
                new = piece[max(0, self._content_sent - offset):]
                offset += len(piece)
                if new and offset > self._content_sent:
                    self._content_sent = offset
                    deltas.append({"content": new})
                continue
            if piece.name is None:
                break  # an unfinished call whose name is not known yet: nothing after it is final either
            deltas.extend(self._call_deltas(index, piece))
            index += 1
        return deltas

    def _call_deltas(self, index: int, call: CallSegment) -> list[dict[str, Any]]:
        deltas = []
        if index == len(self._calls):
            sent = _SentCall(new_tool_call_id())
            self._calls.append(sent)
            deltas.append({"tool_calls": [{"index": index, "id": sent.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
        sent = self._calls[index]
        arguments = call_arguments(call)
        # A parser's segments only grow; text that does not extend what was sent (a parser that broke that rule)
        # is not sent rather than sent twice.
        if len(arguments) > len(sent.arguments) and arguments.startswith(sent.arguments):
            fragment = arguments[len(sent.arguments):]
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
            sent.arguments = arguments
        return deltas
