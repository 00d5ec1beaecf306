"""Incremental detokenization: turn each step's new token ids into the text they add, for streaming.

Decoding the whole output every step costs O(n) per token; instead only a small window of recent tokens is
decoded (the prefix-offset / read-offset technique): the delta is what the window's text gained from its
newest tokens over the text of the tokens before them.
"""

from __future__ import annotations

from collections.abc import Sequence

from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as decoding context: enough that the first output token decodes as it would mid-text
# (a sentencepiece "▁Paris" after a prompt is " Paris", while alone it decodes to "Paris").
NUM_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Feed new output token ids with `step()`, get the text they add; `flush()` at the end.

    Without `prompt_ids`, the concatenated deltas equal `tokenizer.decode(output_ids, skip_special_tokens)`.
    With them, the text is the continuation of the prompt's text: `decode(prompt + output)` minus
    `decode(prompt)`, which differs only for sentencepiece-style tokenizers, whose first output token then
    keeps its leading space.

    A delta never ends inside a character: byte-level tokens may split a multi-byte UTF-8 character, and the
    partial bytes decode to U+FFFD, so text is held back while the window's text ends with U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Skipped special tokens are dropped before they enter the window rather than at decode time: a window
        # must start at a real token, or a sentencepiece decoder would strip the leading space of the token
        # after the special one, which the full decode keeps.
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # Chat prompts end in special tokens that are skipped, so look a little further back for real ones.
        context = self._kept(prompt_ids[-4 * NUM_CONTEXT_TOKENS:])[-NUM_CONTEXT_TOKENS:]
        # A prompt cut inside a character would make the context text end in U+FFFD and never be a clean
        # prefix of the window's text; drop those trailing partial tokens from the context.
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        # The window: its first `_read_offset` tokens were already emitted (or are prompt) and serve only as
        # context that makes the rest decode as it would mid-text; the rest is not emitted yet.
        self._window: list[int] = context
        self._read_offset = len(context)
        self.text = ""  # everything emitted so far

    def _kept(self, ids: Sequence[int]) -> list[int]:
        return [i for i in ids if i not in self._skipped]

    def _decode(self, ids: Sequence[int]) -> str:
        # Special tokens to skip were already filtered out, so whatever is left is decoded as is.
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def step(self, new_ids: Sequence[int]) -> str:
        """Append this step's token ids; return the new text they complete (possibly "")."""
        kept = self._kept(new_ids)
        if not kept:
            return ""
        self._window.extend(kept)
        return self._advance(hold_partial=True)

    def flush(self) -> str:
        """At the end of generation, return any held-back text (an unfinished character, as U+FFFD)."""
        return self._advance(hold_partial=False)

    def _advance(self, *, hold_partial: bool) -> str:
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[:self._read_offset])
        window_text = self._decode(self._window)
        if hold_partial and window_text.endswith(REPLACEMENT_CHAR):
            return ""
        # Decoders are prefix-stable on valid text, so this is exactly what the new tokens added. (A
        # byte-fallback run that turns invalid later can rewrite emitted characters as U+FFFD in a full
        # decode; emitted text cannot be taken back, so streaming then differs in those replacement marks.)
        delta = window_text[len(prefix_text):]
        # The tokens just emitted become the next window's context; older ones are never decoded again.
        del self._window[:self._read_offset]
        self._read_offset = len(self._window)
        self.text += delta
        return delta
