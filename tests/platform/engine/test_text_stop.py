"""Stop strings: caught however the text is split into deltas, never emitted, and nothing else held back."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from ember_platform.engine.text import StopStringMatcher


def run(stop: Sequence[str], pieces: Sequence[str]) -> tuple[str, bool, str | None]:
    """Feed the pieces as deltas; return everything emitted (flush included), whether it stopped, and on what."""
    matcher = StopStringMatcher(stop)
    emitted = []
    for piece in pieces:
        text, stopped, matched = matcher.feed(piece)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True, matched
    emitted.append(matcher.flush())
    return "".join(emitted), False, None


def expected(stop: Sequence[str], text: str) -> tuple[str, bool, str | None]:
    """The reference: cut before the stop string that is complete first (at one end, the one starting first)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    if not hits:
        return text, False, None
    _, start, matched = min(hits)
    return text[:start], True, matched


def splits(text: str, num_cuts: int) -> list[list[str]]:
    """Every way to cut `text` into num_cuts + 1 pieces (empty pieces included)."""
    return [[text[a:b] for a, b in itertools.pairwise((0, *cuts, len(text)))]
            for cuts in itertools.combinations_with_replacement(range(len(text) + 1), num_cuts)]


@pytest.mark.parametrize(("stop", "text"), [
    (["###"], "Hello world###STOP and more"),
    (["</answer>", "\n\n"], "The answer is <b>42</b></answer> trailing"),
    (["你好🙂"], "héllo — 你好🙂 wörld"),
    (["abab"], "abaabab tail"),  # a held "aba" turns out not to match, then a real match follows
    (["abcd", "bc"], "xabcd"),  # "bc" is complete first, whatever the split
    (["b##", "b"], "ab##"),
])
def test_stop_split_across_deltas_at_every_point_is_caught(stop: list[str], text: str) -> None:
    want = expected(stop, text)
    assert want[1]
    for pieces in splits(text, 2):
        assert run(stop, pieces) == want, pieces


def test_text_without_stop_passes_through_whole_including_lookalike_tails() -> None:
    stop = ["###", "<end>"]
    for text in ["Hello ##", "a < end > b", "<en", "#", "## #"]:
        for pieces in splits(text, 2):
            assert run(stop, pieces) == (text, False, None), pieces


def test_random_texts_and_splits_match_the_reference() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        stop = [
            "".join(rng.choice("ab#") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab#c") for _ in range(rng.randint(0, 16)))
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 5)))
        pieces = [text[a:b] for a, b in itertools.pairwise((0, *cuts, len(text)))]
        assert run(stop, pieces) == expected(stop, text), (stop, pieces)


def test_only_a_possible_stop_prefix_is_held_back() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("Hello #") == ("Hello ", False, None)
    assert matcher.feed("x") == ("#x", False, None)
    assert matcher.feed("##") == ("", False, None)
    assert matcher.feed("#") == ("", True, "###")
    assert matcher.feed("more") == ("", True, "###")  # stays stopped
    assert matcher.flush() == ""


def test_no_stop_strings_emit_everything_at_once() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("any#thing") == ("any#thing", False, None)
    assert matcher.flush() == ""


def test_stop_argument_errors() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
    assert run("##", ["a#", "#b"]) == ("a", True, "##")  # a bare string is one stop string
