"""Tiny real tokenizers trained on the spot, for tests and examples that must not download a model.

Two families, as checkpoints ship them: a GPT-2/Llama-3/Qwen-style byte-level BPE, and a Llama-2/Mistral-style
sentencepiece BPE ("▁" for spaces, `<0xNN>` byte-fallback tokens for characters outside its vocabulary).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# A few KB of text with accents, dashes, CJK and emoji, so that byte-level tokens split multi-byte characters.
CORPUS: tuple[str, ...] = (
    "héllo wörld — 你好 🙂 The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text: café, naïve, façade, Zürich, São Paulo, smörgåsbord, crème brûlée.",
    "日本語のテキストと中文文本，以及한국어 텍스트. Emoji: 🎉🚀🙂👍🏽 and symbols: € £ ¥ → ≤ ≥ ∞.",
    "def add(a, b):\n    return a + b  # numbers 0123456789, brackets ([{<>}]) and quotes \"'`",
    "Serving large language models means batching requests, caching keys and values, and streaming text.",
    "A user asks a question; the assistant answers. Conversation roles must alternate user and assistant.",
) * 8

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BYTE_LEVEL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>",
                             "<|start_header_id|>", "<|end_header_id|>")
SENTENCEPIECE_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def train_byte_level_bpe(vocab_size: int = 600, corpus: Sequence[str] = CORPUS,
                         special_tokens: Sequence[str] = BYTE_LEVEL_SPECIAL_TOKENS) -> Tokenizer:
    """A byte-level BPE: every byte has a token, so any text encodes, and tokens can cut a character."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def train_sentencepiece_bpe(vocab_size: int = 300, corpus: Sequence[str] = CORPUS,
                            special_tokens: Sequence[str] = SENTENCEPIECE_SPECIAL_TOKENS) -> Tokenizer:
    """A Llama-2-style tokenizer.json: "▁" spaces, a leading "▁", byte fallback for unknown characters, and
    a post-processor that adds BOS (`special_tokens[1]`)."""
    # Characters rarer than this alphabet limit (CJK, emoji) are left to the <0xNN> byte tokens.
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, limit_alphabet=48)
    base.train_from_iterator(corpus, trainer)
    trained = json.loads(base.to_str())["model"]

    vocab = {token: index for index, token in enumerate(special_tokens)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=special_tokens[0], byte_fallback=True,
                                     fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return add_bos_post_processor(tokenizer, special_tokens[1])


def add_bos_post_processor(tokenizer: Tokenizer, bos_token: str) -> Tokenizer:
    """Make encode() add `bos_token` first, as Llama checkpoints' tokenizer.json files do."""
    bos_id = tokenizer.token_to_id(bos_token)
    if bos_id is None:
        raise ValueError(f"{bos_token!r} is not in the vocabulary")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0", pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_id)])
    return tokenizer


def write_tokenizer_dir(directory: str | Path, tokenizer: Tokenizer, config: Mapping[str, Any],
                        generation_config: Mapping[str, Any] | None = None) -> Path:
    """Save as a checkpoint does: tokenizer.json, tokenizer_config.json and optionally generation_config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    # transformers reads this to pick its generic fast tokenizer class, like most recent checkpoints name.
    full_config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(full_config, indent=2, ensure_ascii=False))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return directory


def write_chatml_tokenizer(directory: str | Path) -> Path:
    """A Qwen-style checkpoint's tokenizer files: byte-level BPE, ChatML template, two end-of-turn tokens."""
    return write_tokenizer_dir(
        directory, train_byte_level_bpe(),
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE},
        generation_config={"eos_token_id": [2, 0]},  # <|im_end|>, <|endoftext|>
    )
