"""One request's output post-processing: the plugins' stream filters and whole-output hooks as one chain.

`PluginHost.output_pipeline` builds an `OutputPipeline` per choice of a request; the replica feeds it the text as
the engine makes it and finishes it once at the end. Each plugin is one stage, in the hooks' call order (a package's
hooks.py first): the filter its `ember_postprocess_stream` returned, or else its `ember_postprocess_output` as a
stage that holds every delta back and rewrites the whole output at the end (the fallback that keeps a plugin written
for whole outputs from leaking anything into a stream).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ember.errors import PluginError

# What OpenAI's clients accept as a choice's finish_reason, and so what a hook may change it to.
FINISH_REASONS = ("stop", "length", "content_filter")


@runtime_checkable
class OutputFilter(Protocol):
    """What `ember_postprocess_stream` returns: one request's stateful filter over its generated text.

    `feed(text)` gets each new piece of text in order and returns what may be sent now: all of it, none of it (held
    back until the filter knows, e.g. a redaction whose pattern may continue in the next piece), or a rewrite. The
    concatenation of the pieces is the model's whole output; where the pieces split it is arbitrary (tokens, steps,
    events), so a filter must not depend on it. `flush(finish_reason)` comes once, after the last piece: it returns
    the text still held back (rewritten as need be), or `(text, finish_reason)` to change the finish_reason too.
    """

    def feed(self, text: str) -> str: ...

    def flush(self, finish_reason: str) -> str | tuple[str, str]: ...


class OutputHookError(PluginError):
    """A post-processing hook or the filter it returned failed, or broke the contract; `plugin` names it."""

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(f"{plugin}: {message}")
        self.plugin = plugin


class _Stage(Protocol):
    plugin: str

    def feed(self, text: str) -> str: ...

    def finish(self, finish_reason: str, token_ids: Sequence[int]) -> tuple[str, str]: ...


class FilterStage:
    """A plugin's `OutputFilter`, with its answers checked and its errors attributed to the plugin."""

    def __init__(self, plugin: str, output_filter: Any) -> None:
        if not isinstance(output_filter, OutputFilter):
            raise OutputHookError(plugin, f"ember_postprocess_stream returned {type(output_filter).__name__!r}, "
                                          "which has no feed(text) and flush(finish_reason) methods")
        self.plugin = plugin
        self._filter = output_filter

    def feed(self, text: str) -> str:
        try:
            emitted = self._filter.feed(text)
        except Exception as e:
            raise OutputHookError(self.plugin, f"its output filter's feed() raised {type(e).__name__}: {e}") from e
        if not isinstance(emitted, str):
            raise OutputHookError(self.plugin, f"its output filter's feed() returned {type(emitted).__name__}, "
                                               "not the text to send (a str)")
        return emitted

    def finish(self, finish_reason: str, token_ids: Sequence[int]) -> tuple[str, str]:
        try:
            result = self._filter.flush(finish_reason)
        except Exception as e:
            raise OutputHookError(self.plugin, f"its output filter's flush() raised {type(e).__name__}: {e}") from e
        if isinstance(result, str):
            return result, finish_reason
        if (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str)
                and isinstance(result[1], str)):
            return result
        raise OutputHookError(self.plugin, f"its output filter's flush() returned {type(result).__name__}, not the "
                                           "text still held back (a str) or (text, finish_reason)")


class WholeOutputStage:
    """A plugin's `ember_postprocess_output` in a stream: nothing goes out until the whole output is known."""

    def __init__(self, plugin: str, call: Callable[..., Any], request: Mapping[str, Any], manifest: Any) -> None:
        self.plugin = plugin
        self._call = call
        self._request = request
        self._manifest = manifest
        self._parts: list[str] = []

    def feed(self, text: str) -> str:
        self._parts.append(text)
        return ""

    def finish(self, finish_reason: str, token_ids: Sequence[int]) -> tuple[str, str]:
        output = {"text": "".join(self._parts), "token_ids": list(token_ids), "finish_reason": finish_reason}
        self._parts = []
        try:
            replaced = self._call(output=output, request=self._request, manifest=self._manifest)
        except OutputHookError:
            raise
        except PluginError as e:  # the host's wrapper already named the plugin and the hook
            raise OutputHookError(self.plugin, str(e).removeprefix(f"{self.plugin}: ")) from e
        if replaced is None:
            return output["text"], finish_reason
        if not isinstance(replaced, Mapping):
            raise OutputHookError(self.plugin, f"ember_postprocess_output returned {type(replaced).__name__}, not "
                                               "an output dict or None")
        text = replaced.get("text", output["text"])
        reason = replaced.get("finish_reason", finish_reason)
        if not isinstance(text, str) or not isinstance(reason, str):
            raise OutputHookError(self.plugin, "ember_postprocess_output returned an output whose 'text' or "
                                               "'finish_reason' is not a str")
        return text, reason


class OutputPipeline:
    """The post-processing of one choice: `feed` each delta of its text, `finish` once; or `apply` to a whole one.

    `buffers` is true when a stage holds the whole output back (a plugin with only `ember_postprocess_output`): the
    stream then carries the text at its end, as one piece.
    """

    def __init__(self, stages: Sequence[_Stage]) -> None:
        if not stages:
            raise ValueError("an output pipeline needs at least one stage")
        self.stages = list(stages)
        self.plugins = [stage.plugin for stage in self.stages]
        self.buffers = any(isinstance(stage, WholeOutputStage) for stage in self.stages)

    def feed(self, text: str) -> str:
        for stage in self.stages:
            if not text:
                return ""  # a stage held it all back: the later ones see only pieces with text
            text = stage.feed(text)
        return text

    def finish(self, finish_reason: str, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """The text still held back by every stage, and the finish_reason after the stages that changed it."""
        tail = ""
        for stage in self.stages:
            emitted = stage.feed(tail) if tail else ""
            held, reason = stage.finish(finish_reason, token_ids)
            if reason != finish_reason and reason not in FINISH_REASONS:
                raise OutputHookError(stage.plugin, f"changed finish_reason to {reason!r}: it must be one of "
                                                    f"{', '.join(FINISH_REASONS)}")
            tail, finish_reason = emitted + held, reason
        return tail, finish_reason

    def apply(self, text: str, token_ids: Sequence[int], finish_reason: str) -> tuple[str, str]:
        """A whole output at once (a response that is not streamed): its final text and finish_reason."""
        head = self.feed(text)
        tail, finish_reason = self.finish(finish_reason, token_ids)
        return head + tail, finish_reason
