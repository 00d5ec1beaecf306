"""Tool calling: the contract tool-call parsers implement (one per model family's output format), and what the
replica does with them: parse a finished output, stream calls as OpenAI deltas, constrain `required` choices.

Torch-free, standard library only: the parsers run beside the HTTP layer.
"""

from .calls import Tool, ToolCall, ToolUse, new_tool_call_id
from .parser import CallSegment, Segment, TextSegment, ToolParser, parse_tool_calls
from .stream import ToolCallStream

__all__ = ["CallSegment", "Segment", "TextSegment", "Tool", "ToolCall", "ToolCallStream", "ToolParser",
           "ToolUse", "new_tool_call_id", "parse_tool_calls"]
