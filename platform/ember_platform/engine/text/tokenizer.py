"""A model's tokenizer, loaded from a Hugging Face checkpoint directory the way transformers loads it.

Only the `tokenizers` library (Rust) runs here: transformers is a test-time reference, not a serving dependency.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, processors

from ember.chat_templates import ChatTemplates, load_chat_templates

from .chat_template import ChatTemplateError, render_chat_template

# transformers' named special tokens; all of them are visible to chat templates as `{{ bos_token }}` etc.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

GIL_FREE_ENCODE_CHARS = 4096  # shorter texts encode faster holding the GIL (~25 us less) than releasing it


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's pieces for bytes outside its vocabulary


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2's) writes each byte as one printable character: the printable Latin-1 bytes as
    themselves, every other byte as U+0100, U+0101, ... in byte order. This maps such characters back to bytes."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    # Configs write a token as "<s>" or as a serialized AddedToken {"content": "<s>", "lstrip": false, ...}.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    # generation_config's eos_token_id is an int, or a list of them for models with several end tokens (Llama 3).
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """Encode, decode and chat-format text for one model.

    Usually built with `from_dir`; the constructor takes ownership of `backend` and adjusts it (special tokens,
    post-processor) the way transformers does when it loads the same files.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str] | None = None,
                 extra_special_tokens: Sequence[str] = (), add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None, chat_template: ChatTemplates | None = None,
                 extra_eos_token_ids: Iterable[int] = (), pad_token_id: int | None = None,
                 name: str = "tokenizer") -> None:
        self.backend = backend
        self.name = name
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if k in SPECIAL_TOKEN_NAMES and v}
        self.chat_template = chat_template

        # transformers registers every named special token as a special added token (reusing the id when the
        # vocabulary already has it), which is what makes decode(skip_special_tokens=True) drop them.
        named = [*self.special_tokens.values(), *extra_special_tokens]
        if named:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named)])

        # What encode() adds is tokenizer.json's post-processor (Llama's adds BOS), as in transformers 5, which
        # ignores the config's `add_bos_token` then. A tokenizer.json without one gets the flags' BOS/EOS, as
        # transformers 4's Llama tokenizer did: a model trained with BOS degrades badly without it.
        if backend.post_processor is None and (add_bos_token or add_eos_token):
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))

        self.bos_token_id = self._special_id("bos_token")
        eos_ids = {*extra_eos_token_ids}
        if (eos_id := self._special_id("eos_token")) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        tokenizer_pad_id = self._special_id("pad_token")
        self.pad_token_id: int | None = tokenizer_pad_id if tokenizer_pad_id is not None else pad_token_id
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special)
        self._added_token_ids = frozenset(backend.get_added_tokens_decoder())
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` plus tokenizer_config / special_tokens_map / generation_config / chat templates."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {directory}: Ember needs the fast (`tokenizers`) serialization; "
                f"save one with transformers' `AutoTokenizer.from_pretrained(...).save_pretrained({str(directory)!r})`")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise ValueError(f"{tokenizer_file} could not be loaded: {e}") from e

        config = _read_json(directory / "tokenizer_config.json")
        # Legacy checkpoints keep their special tokens in special_tokens_map.json, which wins over the config;
        # transformers ignores the file once the config carries `added_tokens_decoder` (the modern format).
        if "added_tokens_decoder" not in config:
            config = {**config, **_read_json(directory / "special_tokens_map.json")}
        generation = _read_json(directory / "generation_config.json")

        special = {name: tok for name in SPECIAL_TOKEN_NAMES if (tok := _token_content(config.get(name)))}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra_tokens = [tok for item in extra if (tok := _token_content(item))] if isinstance(extra, list) else []
        pad_ids = _as_id_list(generation.get("pad_token_id"))
        return cls(
            backend,
            special_tokens=special,
            extra_special_tokens=extra_tokens,
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
            chat_template=load_chat_templates(directory, config),
            extra_eos_token_ids=_as_id_list(generation.get("eos_token_id")),
            pad_token_id=pad_ids[0] if pad_ids else None,
            name=str(directory),
        )

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        specials = [(tok, self.backend.token_to_id(tok)) for tok, on in ((bos, add_bos), (eos, add_eos)) if on]
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included (transformers' `len(tok)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < GIL_FREE_ENCODE_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # `encode` holds the GIL for the whole call (seconds for a long prompt, while no other thread, an event loop
        # included, runs); `encode_batch` releases it and gives the same ids.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. A byte-level token may hold part of a UTF-8 character, whose text alone
        is U+FFFD: OpenAI's logprobs report the token's own bytes (`bytes`), so that a client can join them."""
        piece = self.backend.id_to_token(token_id)
        if piece is not None and token_id not in self._added_token_ids:
            if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            if match := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def get_chat_template(self, chat_template: str | None = None, *, tools: Sequence[Any] | None = None) -> str:
        """The template to render, chosen as transformers chooses it.

        `chat_template` names one of the model's templates, or else is a template itself; without it: the
        `tool_use` template when tools are given and it exists, else `default`, else the model's only one.
        """
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ChatTemplateError(f"{self.name} has several chat templates and none named 'default': "
                                    f"choose one of {sorted(templates)}")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ChatTemplateError(
                f"{self.name} has no chat template (no 'chat_template' in tokenizer_config.json and no "
                f"chat_template.jinja): use the completions API, or add a template to the model")
        return templates

    def apply_chat_template(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, chat_template: str | None = None,
                            **extra: Any) -> str:
        """Render messages to prompt text; `extra` variables reach the template and override special tokens.

        `chat_template` is a template name or a template (see `get_chat_template`).
        """
        template = self.get_chat_template(chat_template, tools=tools)
        variables = {**self.special_tokens, **extra}
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    **variables)

    def chat_prompt_ids(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                        tools: Sequence[Mapping[str, Any]] | None = None, chat_template: str | None = None,
                        add_special_tokens: bool = False, **extra: Any) -> list[int]:
        """Token ids of the rendered chat, as transformers' `apply_chat_template(tokenize=True)` gives them.

        Templates write their own BOS, so by default (like transformers) nothing is added. With
        `add_special_tokens=True` the tokenizer's BOS/EOS are added too, but never a second BOS in front of
        one the template already wrote.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        chat_template=chat_template, **extra)
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        bos = self.bos_token_id
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos] and text.startswith(self.bos_token or ""):
            del ids[0]
        return ids

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"
