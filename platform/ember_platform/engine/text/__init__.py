"""The engine's text layer: tokenizer, chat templates, streaming detokenization and stop strings."""

from .chat_template import ChatTemplateError, render_chat_template
from .detokenizer import IncrementalDetokenizer
from .stop import StopStringMatcher
from .tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "StopStringMatcher", "Tokenizer", "render_chat_template"]
