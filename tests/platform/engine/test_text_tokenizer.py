"""Tokenizer: loading a checkpoint's tokenizer files, and encode/decode/chat output equal to transformers'."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from ember_platform.engine.text import ChatTemplateError, Tokenizer
from ember_platform.engine.text.testing import (
    CHATML_TEMPLATE,
    add_bos_post_processor,
    train_byte_level_bpe,
    train_sentencepiece_bpe,
    write_tokenizer_dir,
)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "héllo wörld — 你好 🙂",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\nnew lines\n\n",
    "unseen: zebra 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👍🏽 ⚡ ok",
    "special tokens inline: <|im_start|>user hi<|im_end|> <s> </s>",
    "",
]

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

CONVERSATION = [
    {"role": "system", "content": "You are terse. Réponds en français — 好的 🙂"},
    {"role": "user", "content": "  What is 2 + 2?  "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And <|im_end|> inside a message?"},
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "chatml": write_tokenizer_dir(
            root / "chatml", train_byte_level_bpe(),
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE},
            generation_config={"eos_token_id": [2, 0]}),
        "llama3": write_tokenizer_dir(
            root / "llama3", add_bos_post_processor(train_byte_level_bpe(), "<|begin_of_text|>"),
            {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
             "chat_template": LLAMA3_TEMPLATE},
            generation_config={"bos_token_id": 3, "eos_token_id": [4, 0]}),
        "mistral": write_tokenizer_dir(
            root / "mistral", train_sentencepiece_bpe(),
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
             "add_eos_token": False, "chat_template": MISTRAL_TEMPLATE}),
    }


@pytest.fixture(scope="module")
def pairs(checkpoints: dict[str, Path]) -> dict[str, tuple[Tokenizer, Any]]:
    """Ours and transformers' tokenizer, loaded from the same files."""
    return {name: (Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(str(path)))
            for name, path in checkpoints.items()}


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral"])
def test_encode_and_decode_equal_transformers(pairs: dict[str, tuple[Tokenizer, Any]], name: str) -> None:
    ours, hf = pairs[name]
    assert ours.vocab_size == len(hf)
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special), (text, add_special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 20))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    for token_id in (0, 5, ours.vocab_size - 1):
        assert ours.id_to_token(token_id) == hf.convert_ids_to_tokens(token_id)


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral"])
def test_special_token_ids_equal_transformers(pairs: dict[str, tuple[Tokenizer, Any]], name: str) -> None:
    ours, hf = pairs[name]
    assert ours.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_token_ids
    assert ours.special_token_ids == frozenset(hf.all_special_ids) | {
        i for i, t in hf.added_tokens_decoder.items() if t.special}


def test_add_bos_token_adds_bos_llama_style(pairs: dict[str, tuple[Tokenizer, Any]]) -> None:
    for name in ("llama3", "mistral"):
        ours, _ = pairs[name]
        assert ours.encode("hi")[0] == ours.bos_token_id
        assert ours.bos_token_id not in ours.encode("hi", add_special_tokens=False)
    chatml, _ = pairs["chatml"]
    assert chatml.bos_token_id is None
    assert chatml.encode("hi") == chatml.encode("hi", add_special_tokens=False)


def test_eos_token_ids_union_tokenizer_and_generation_config(pairs: dict[str, tuple[Tokenizer, Any]]) -> None:
    chatml, llama3 = pairs["chatml"][0], pairs["llama3"][0]
    assert chatml.eos_token_ids == {chatml.token_to_id("<|im_end|>"), chatml.token_to_id("<|endoftext|>")}
    assert llama3.eos_token_ids == {llama3.token_to_id("<|eot_id|>"), llama3.token_to_id("<|endoftext|>")}
    assert chatml.pad_token_id == chatml.token_to_id("<|endoftext|>")
    assert llama3.pad_token_id is None


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_and_prompt_ids_equal_transformers(pairs: dict[str, tuple[Tokenizer, Any]], name: str,
                                                         add_generation_prompt: bool) -> None:
    ours, hf = pairs[name]
    messages = CONVERSATION[1:] if name == "mistral" else CONVERSATION  # Mistral's template has no system role
    expected_text = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected_text
    expected_ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          return_dict=False)
    assert ours.chat_prompt_ids(messages, add_generation_prompt=add_generation_prompt) == list(expected_ids)


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_chat_prompt_ids_never_doubles_the_templates_bos(pairs: dict[str, tuple[Tokenizer, Any]], name: str) -> None:
    ours, _ = pairs[name]
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages).startswith(ours.bos_token or "")
    for add_special in (False, True):
        ids = ours.chat_prompt_ids(messages, add_special_tokens=add_special)
        assert ids[0] == ours.bos_token_id and ids[1] != ours.bos_token_id


def test_template_raise_exception_message_reaches_the_user(pairs: dict[str, tuple[Tokenizer, Any]]) -> None:
    llama3, mistral = pairs["llama3"][0], pairs["mistral"][0]
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        llama3.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        mistral.chat_prompt_ids([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="Conversation roles must alternate"):  # the HTTP layer's 400
        mistral.apply_chat_template([{"role": "assistant", "content": "a"}])


def test_missing_tokenizer_json_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_jinja_file_overrides_config(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path, train_byte_level_bpe(vocab_size=300),
                                    {"eos_token": "<|im_end|>", "chat_template": "from config"})
    assert Tokenizer.from_dir(directory).chat_template == "from config"
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }} from file")
    ours = Tokenizer.from_dir(directory)
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi from file"


def test_named_templates_use_default_or_tool_use(tmp_path: Path) -> None:
    templates = [{"name": "default", "template": "default:{{ messages|length }}"},
                 {"name": "tool_use", "template": "tools:{{ tools|length if tools else 0 }}"}]
    directory = write_tokenizer_dir(tmp_path, train_byte_level_bpe(vocab_size=300), {"chat_template": templates})
    ours = Tokenizer.from_dir(directory)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert ours.apply_chat_template(messages) == "default:1" == hf.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages, tools=tools) == "tools:1"
    assert ours.apply_chat_template(messages, chat_template="tool_use") == "tools:0"
    assert ours.apply_chat_template(messages, chat_template="inline {{ messages|length }}") == "inline 1"


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path, train_byte_level_bpe(vocab_size=300), {})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "hi"}])


def test_legacy_special_tokens_map_supplies_tokens(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path, train_sentencepiece_bpe(vocab_size=280), {"add_bos_token": True})
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "unk_token": "<unk>"}))
    ours = Tokenizer.from_dir(directory)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert ours.bos_token_id == hf.bos_token_id == ours.token_to_id("<s>")
    assert ours.eos_token_ids == {ours.token_to_id("</s>")}
    assert ours.encode("héllo") == hf.encode("héllo")


def test_config_add_bos_token_applies_when_tokenizer_json_has_no_post_processor(tmp_path: Path) -> None:
    # transformers 5 ignores the flag once tokenizer.json exists; transformers 4's Llama tokenizer (and this one)
    # add BOS, as the model was trained with it. The fast tokenizer given the flag directly agrees.
    backend = train_sentencepiece_bpe(vocab_size=280)
    backend.post_processor = None
    directory = write_tokenizer_dir(tmp_path, backend, {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    ours = Tokenizer.from_dir(directory)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token="<s>",
                                              eos_token="</s>", add_bos_token=True)
    assert ours.encode("héllo wörld") == hf.encode("héllo wörld")
    assert ours.encode("héllo wörld")[0] == ours.bos_token_id


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_token_bytes_rebuild_the_text_even_where_a_token_holds_part_of_a_character(
        pairs: dict[str, tuple[Tokenizer, Any]], name: str) -> None:
    ours, _ = pairs[name]
    partial = 0
    for text in TEXTS:
        ids = [i for i in ours.encode(text) if i not in ours.special_token_ids]
        assert b"".join(ours.token_bytes(i) for i in ids) == ours.decode(ids).encode()
        partial += sum(ours.decode([i]) == "\ufffd" for i in ids)
    assert partial  # the case the bytes are for: a token whose text alone is U+FFFD
    special = next(iter(ours.special_token_ids))
    assert ours.token_bytes(special) == ours.decode([special], skip_special_tokens=False).encode()


def test_token_bytes_of_sentencepiece_byte_fallback_pieces(pairs: dict[str, tuple[Tokenizer, Any]]) -> None:
    ours, _ = pairs["mistral"]
    ids = ours.encode("𝔘", add_special_tokens=False)  # not in the small vocabulary: four byte pieces
    pieces = [i for i in ids if (ours.id_to_token(i) or "").startswith("<0x")]
    assert len(pieces) == 4 and all(ours.decode([i]) == "\ufffd" for i in pieces)
    assert b"".join(ours.token_bytes(i) for i in pieces) == "𝔘".encode()


def test_token_bytes_of_the_example_models_byte_level_tokens() -> None:
    tokenizer = Tokenizer.from_dir(Path(__file__).resolve().parents[3] / "examples" / "tiny-llama" / "weights")
    ids = tokenizer.encode("€", add_special_tokens=False)
    assert [tokenizer.token_bytes(i) for i in ids] == [b"\xe2", b"\x82", b"\xac"]
