"""Incremental detokenization: streamed deltas add up to the full decode and never cut a character."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ember_platform.engine.text import IncrementalDetokenizer, Tokenizer
from ember_platform.engine.text.testing import (
    CORPUS,
    train_sentencepiece_bpe,
    write_chatml_tokenizer,
    write_tokenizer_dir,
)

FFFD = "\ufffd"
VALID_TEXTS = ["héllo wörld — 你好 🙂", "Emoji: 🎉🚀🙂👍🏽 ok", "日本語のテキスト", " spaced  out ", "a\nb\tc",
               *CORPUS[:6]]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_chatml_tokenizer(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = write_tokenizer_dir(tmp_path_factory.mktemp("sp"), train_sentencepiece_bpe(),
                                    {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return Tokenizer.from_dir(directory)


def stream(tokenizer: Tokenizer, ids: Sequence[int], rng: random.Random, *, prompt_ids: Sequence[int] = (),
           skip_special_tokens: bool = True, max_step: int = 3) -> list[str]:
    """Feed `ids` in random step sizes (0 included: a step may add nothing) and return every delta, flush last."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas, start = [], 0
    while start < len(ids):
        size = rng.randint(0, max_step)
        deltas.append(detokenizer.step(ids[start:start + size]))
        start += size
    deltas.append(detokenizer.flush())
    assert detokenizer.text == "".join(deltas)
    return deltas


def assert_streams_like_full_decode(tokenizer: Tokenizer, ids: Sequence[int], deltas: list[str],
                                    skip_special_tokens: bool = True) -> None:
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full, ids
    if FFFD not in full:
        assert not any(FFFD in delta for delta in deltas), (ids, deltas)


def test_byte_level_tokens_really_split_characters(byte_level: Tokenizer) -> None:
    # The premise of the tests below: some tokens hold only part of a character's UTF-8 bytes.
    ids = byte_level.encode("👍🏽 ⚡ 𝔘")
    assert any(byte_level.decode([i]).endswith(FFFD) for i in ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_byte_level_sequences_stream_as_full_decode(byte_level: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(1)
    for _ in range(150):
        ids = [rng.randrange(byte_level.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas = stream(byte_level, ids, rng, skip_special_tokens=skip_special_tokens)
        assert_streams_like_full_decode(byte_level, ids, deltas, skip_special_tokens)


def test_valid_text_one_token_at_a_time_never_emits_a_partial_character(byte_level: Tokenizer,
                                                                      sentencepiece: Tokenizer) -> None:
    rng = random.Random(2)
    for tokenizer in (byte_level, sentencepiece):
        for text in VALID_TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            deltas = stream(tokenizer, ids, rng, max_step=1)
            assert_streams_like_full_decode(tokenizer, ids, deltas)


def test_sentencepiece_sequences_with_special_tokens_stream_as_full_decode(sentencepiece: Tokenizer) -> None:
    # Random runs of real tokens, byte-fallback characters and special tokens. (Byte-fallback tokens are
    # only drawn as whole characters: an invalid byte run makes the full decode rewrite earlier characters.)
    rng = random.Random(3)
    pieces = [sentencepiece.encode(t, add_special_tokens=False) for t in ["你", "🚀", "é", " 👍🏽", "日本"]]
    plain = [i for i in range(sentencepiece.vocab_size)
             if not (sentencepiece.id_to_token(i) or "").startswith("<0x")]
    specials = sorted(sentencepiece.special_token_ids)
    for _ in range(150):
        ids: list[int] = []
        while len(ids) < rng.randint(1, 25):
            kind = rng.random()
            ids += rng.choice(pieces) if kind < 0.3 else [rng.choice(specials)] if kind < 0.4 else [rng.choice(plain)]
        for skip in (True, False):
            deltas = stream(sentencepiece, ids, rng, skip_special_tokens=skip)
            assert_streams_like_full_decode(sentencepiece, ids, deltas, skip)


def test_prompt_context_keeps_the_leading_space_of_a_continuation(sentencepiece: Tokenizer,
                                                                  byte_level: Tokenizer) -> None:
    rng = random.Random(4)
    prompt = sentencepiece.encode("The quick brown")
    output = sentencepiece.encode("fox jumps — 🙂 你好", add_special_tokens=False)  # "▁fox", "▁jumps", ...
    deltas = stream(sentencepiece, output, rng, prompt_ids=prompt)
    # Alone, "▁fox" decodes to "fox"; after the prompt it is " fox", as in decode(prompt + output).
    assert "".join(deltas) == " fox jumps — 🙂 你好"
    assert sentencepiece.decode(prompt + output) == sentencepiece.decode(prompt) + "".join(deltas)
    # Byte-level tokens carry their own spaces, so context changes nothing there.
    prompt, output = byte_level.encode("The quick brown"), byte_level.encode(" fox 🙂", add_special_tokens=False)
    assert "".join(stream(byte_level, output, rng, prompt_ids=prompt)) == " fox 🙂"


def test_chat_prompt_ending_in_special_tokens_gives_context(byte_level: Tokenizer) -> None:
    prompt = byte_level.chat_prompt_ids([{"role": "user", "content": "hi"}])
    output = [*byte_level.encode("Hello 🙂", add_special_tokens=False), byte_level.token_to_id("<|im_end|>") or 0]
    assert "".join(stream(byte_level, output, random.Random(5), prompt_ids=prompt)) == "Hello 🙂"


def test_prompt_cut_inside_a_character_streams_the_outputs_own_decode(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("ab 👍🏽⚡ done", add_special_tokens=False)
    rng = random.Random(6)
    for cut in range(1, len(ids)):
        prompt, output = ids[:cut], ids[cut:]
        deltas = stream(byte_level, output, rng, prompt_ids=prompt)
        assert_streams_like_full_decode(byte_level, output, deltas)


def test_only_a_small_window_is_decoded_per_step(byte_level: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = byte_level.encode(" ".join(CORPUS), add_special_tokens=False)
    assert len(ids) > 500
    decoded_lengths: list[int] = []
    decode = byte_level.decode

    def counting_decode(token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        decoded_lengths.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(byte_level, "decode", counting_decode)
    deltas = stream(byte_level, ids, random.Random(7), prompt_ids=ids[:50], max_step=1)
    monkeypatch.undo()
    assert "".join(deltas) == byte_level.decode(ids)
    assert max(decoded_lengths) <= 12  # context + the few tokens of one held-back character


def test_an_empty_stream_emits_nothing(byte_level: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(byte_level)
    assert detokenizer.step([]) == "" and detokenizer.flush() == "" and detokenizer.text == ""
