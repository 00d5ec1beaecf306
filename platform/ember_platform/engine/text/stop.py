"""Stop strings: end generation where the first stop string completes; the stop string is never emitted.

A stop string can arrive split across tokens and deltas ("###" as "#" then "##"), so text that could still
become the start of one is held back until the next delta decides it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text deltas; get back the text safe to emit, whether a stop string ended it, and which one."""

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):  # a bare string would otherwise become one stop string per character
            stop = [stop]
        for s in stop:
            if not s:
                raise ValueError("stop strings must be non-empty: an empty one would match before any text")
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._held = ""  # a tail that is a proper prefix of some stop string
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str) -> tuple[str, bool, str | None]:
        """Return (text to emit, stopped, matched stop string). After a stop, further deltas emit nothing."""
        if self.matched is not None:
            return "", True, self.matched
        if not self.stop:
            return delta, False, None
        text = self._held + delta
        # Generation stops where the first stop string is complete, so the match that ends first wins (at one
        # end, the one starting first). Unlike "the earliest start", this does not depend on how the text was
        # split into deltas: for stops "abcd" and "bc", "abc" has already stopped at "bc".
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            self._held = ""
            self.matched = best[2]
            return text[:best[1]], True, self.matched
        held = self._partial_stop_length(text)
        self._held = text[len(text) - held:] if held else ""
        return text[:len(text) - held], False, None

    def _partial_stop_length(self, text: str) -> int:
        # The longest tail of `text` that begins some stop string (shorter than it: a whole one would have
        # matched). Held-back text can only be shorter than the longest stop string, so this stays cheap.
        longest = 0
        for s in self.stop:
            for length in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:length]):
                    longest = length
                    break
        return longest

    def flush(self) -> str:
        """At the end of generation with no stop matched, the held-back text (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
