"""Hostile request bodies at the protocol layer, which the replica parses with: nesting depth, lone surrogates in
every text field, prompt fan-out. Each is a ProtocolError naming the field, never a Python exception."""

from __future__ import annotations

import json

import pytest

from ember_platform.gateway.errors import ProtocolError
from ember_platform.gateway.protocol import MAX_PROMPTS, parse_chat_request, parse_completion_request
from ember_platform.gateway.request_body import (
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    json_depth_exceeds,
    loads,
    lone_surrogate_path,
    request_id,
)


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    return opener * depth + closer * depth


def test_depth_is_counted_exactly_for_arrays_and_objects() -> None:
    assert not json_depth_exceeds(nested(MAX_JSON_DEPTH))
    assert json_depth_exceeds(nested(MAX_JSON_DEPTH + 1))
    objects = b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1)
    assert json_depth_exceeds(objects)
    assert json_depth_exceeds(b"[{" * 40 + b"}]" * 40)  # 80 levels, mixed
    wide = b"[" + b",".join([b"[[1]]"] * 5000) + b"]"  # many brackets, three levels
    assert not json_depth_exceeds(wide)
    json.loads(wide)


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"prompt": "[" * 5000 + '\\"{' * 100, "stop": ["]]]"]}).encode()
    assert not json_depth_exceeds(text)
    assert loads(text)["prompt"].startswith("[[[")


def test_deep_nesting_is_an_invalid_json_400_not_a_recursion_error() -> None:
    body = b'{"model": "m", "prompt": ' + nested(10_000) + b"}"
    for parse in (parse_completion_request, parse_chat_request):
        with pytest.raises(ProtocolError) as caught:
            parse(body)
        assert caught.value.status == 400 and caught.value.code == "invalid_json"
        assert str(MAX_JSON_DEPTH) in caught.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m\ud800", "prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x\udfff"}, "prompt"),
    ({"model": "m", "prompt": ["ok", "\udc00"]}, "prompt[1]"),
    ({"model": "m", "prompt": "x", "stop": ["a", "\ud83d"]}, "stop[1]"),
    ({"model": "m", "prompt": "x", "user": "\ud800"}, "user"),
    ({"model": "m", "prompt": "x", "extra": {"\ud800key": 1}}, "extra.\\ud800key"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(body: dict, param: str) -> None:
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a \uXXXX escape, as a client sends it
    for sent in (raw, body):  # raw bytes (the replica's path) or already decoded
        with pytest.raises(ProtocolError) as caught:
            parse_completion_request(sent)
        error = caught.value
        assert (error.status, error.param, error.code) == (400, param, "invalid_unicode")
        json.dumps(error.body(), ensure_ascii=False).encode("utf-8")  # the error itself can be sent


def test_a_lone_surrogate_in_a_chat_message_names_the_message() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "ok"},
                                       {"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]}
    with pytest.raises(ProtocolError) as caught:
        parse_chat_request(json.dumps(body))
    assert caught.value.param == "messages[1].content[0].text"


def test_surrogate_pairs_are_ordinary_text() -> None:
    raw = json.dumps({"model": "m", "prompt": "smile \U0001F600"}).encode()  # "\ud83d\ude00": a valid pair
    assert parse_completion_request(raw).prompt == "smile \U0001F600"
    assert lone_surrogate_path(json.loads(raw)) is None


@pytest.mark.parametrize("prompt", [["x"] * (MAX_PROMPTS + 1), [[1, 2]] * (MAX_PROMPTS + 1)])
def test_prompt_lists_are_capped(prompt: list) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_completion_request({"model": "m", "prompt": prompt})
    assert caught.value.status == 400 and caught.value.param == "prompt"
    assert len(parse_completion_request({"model": "m", "prompt": prompt[:MAX_PROMPTS]}).prompts()) == MAX_PROMPTS


def test_a_body_of_too_many_values_is_refused_before_json_loads_holds_the_loop() -> None:
    flat = b'{"model": "m", "prompt": [' + b",".join([b"1"] * (MAX_JSON_VALUES + 1)) + b"]}"
    with pytest.raises(ProtocolError) as caught:
        loads(flat)
    assert (caught.value.status, caught.value.code) == (413, "request_too_large")
    in_strings = json.dumps({"prompt": "[1, 2], {3}" * MAX_JSON_VALUES}).encode()  # commas in text do not count
    assert loads(in_strings)["prompt"].startswith("[1, 2]")
    token_ids = json.dumps({"model": "m", "prompt": [list(range(2048))] * MAX_PROMPTS}).encode()
    assert len(parse_completion_request(token_ids).prompts()) == MAX_PROMPTS  # the largest batch still fits


def test_lone_surrogates_sent_as_raw_bytes_are_caught_too() -> None:
    # json.loads decodes the UTF-8-style bytes of a surrogate ("surrogatepass") instead of refusing them.
    with pytest.raises(ProtocolError) as caught:
        parse_chat_request(b'{"model": "\xed\xa0\x80", "messages": [{"role": "user", "content": "x"}]}')
    assert (caught.value.param, caught.value.code) == ("model", "invalid_unicode")
    assert parse_completion_request('{"model": "m", "prompt": "\ud7ff"}'.encode()).prompt == "\ud7ff"  # not one


def test_a_request_id_is_the_clients_only_when_it_is_a_short_plain_token() -> None:
    assert request_id("req-1.a:b_C") == "req-1.a:b_C"
    for hostile in ("\xff" * 10, "r" * 5000, "a b", "x\r\nSet-Cookie: y", "", None):
        generated = request_id(hostile)
        assert generated != hostile and len(generated) == 32 and generated.isalnum()


@pytest.mark.parametrize("raw, param", [
    (b'{"max_tokens": 1e999}', "max_tokens"),
    (b'{"logit_bias": {"5": -Infinity}}', "logit_bias.5"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "top_p": 1' + b"0" * 400 + b'.0}', "top_p"),
    (b'{"prompt": [1, 2], "stop": ["a"], "n": [1e400]}', "n[0]"),
])
def test_a_number_that_is_not_finite_is_a_400_naming_the_field(raw: bytes, param: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        loads(raw)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, "invalid_value")
    json.dumps(caught.value.body(), allow_nan=False)  # the error itself can be sent


def test_finite_numbers_and_words_like_nan_in_text_pass() -> None:
    raw = b'{"prompt": "NaN and Infinity, 1e999", "temperature": 1e-300, "max_tokens": 1e300, "seed": 1' + \
        b"0" * 400 + b"}"
    loads(raw)  # an int of 400 digits is finite (the protocol bounds it later)
