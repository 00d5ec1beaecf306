"""Hand-written hostile requests, one class per test, against the real `ember serve` of the fuzz suite: deep
nesting, lone surrogates in every string field, huge numbers, bad output limits, wrong types at every field, token
ids out of range, huge prompt lists, invalid UTF-8, wrong content types, oversized bodies, odd paths and headers.
Same property as the schema-driven campaign (tests/fuzz/conftest.py: `violations`), and the server stays healthy
after each class. Each class runs (none is skipped) even where another change is still fixing it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

MODEL = "tiny-llama"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PER_MODEL_CHAT, PER_MODEL_COMPLETIONS = f"/models/{MODEL}/v1/chat/completions", f"/models/{MODEL}/v1/completions"
VOCAB = 4096  # tiny-llama's tokenizer (examples/tiny-llama/weights/config.json)

Request = tuple[str, str, dict[str, str], bytes]  # method, path, extra headers, body


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4, **fields}


def post(path: str, body: Any, headers: dict[str, str] | None = None) -> Request:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return "POST", path, {"Content-Type": "application/json", **(headers or {})}, raw


def both(**fields: Any) -> Iterator[Request]:
    yield post(CHAT, chat(**fields))
    yield post(COMPLETIONS, completion(**fields))


# Every field both endpoints take, with a valid value, so that each can be broken alone.
SHARED_FIELDS: dict[str, Any] = {
    "model": MODEL, "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "n": 1, "stop": ["\n"], "seed": 1,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
    "stream": False, "user": "u", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.0, "min_tokens": 0,
    "ignore_eos": False, "stop_token_ids": [1], "cache_salt": "salt",
}
CHAT_FIELDS = {**SHARED_FIELDS, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4,
               "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "parallel_tool_calls": False}
COMPLETION_FIELDS = {**SHARED_FIELDS, "prompt": "x", "logprobs": 0, "echo": False, "suffix": "", "best_of": 1}
WRONG_TYPES: list[Any] = [None, True, 0, -1, 1.5, "x", "", [], [None], [[]], {}, {"a": {"b": []}}, "\x00"]
SURROGATES = ["\ud800", "\udfff", "a\udc80b", "\ud83d"]  # lone halves; "\ud83d\ude00" (a pair) is a valid emoji


def deep_nesting() -> Iterator[Request]:
    for depth in (1_000, 10_000, 100_000):
        for opener, closer in (("[", "]"), ('{"a":', "}")):
            nested = opener * depth + "1" + closer * depth
            yield post(CHAT, f'{{"model":"{MODEL}","messages":{nested}}}'.encode())
            yield post(COMPLETIONS, f'{{"model":"{MODEL}","prompt":"x","max_tokens":4,"user":{nested}}}'.encode())
            yield post(CHAT, nested.encode())
    unclosed = "[" * 100_000
    yield post(COMPLETIONS, f'{{"model":"{MODEL}","prompt":{unclosed}'.encode())


def _with_string(value: Any, replacement: str) -> Iterator[Any]:
    """Copies of `value` with one string in it (or one key) replaced, for every string in it."""
    if isinstance(value, str):
        yield replacement
    elif isinstance(value, list):
        for i, item in enumerate(value):
            for changed in _with_string(item, replacement):
                yield [*value[:i], changed, *value[i + 1:]]
    elif isinstance(value, dict):
        for key, item in value.items():
            for changed in _with_string(item, replacement):
                yield {**value, key: changed}
            yield {**{k: v for k, v in value.items() if k != key}, replacement: item}


def lone_surrogates() -> Iterator[Request]:
    for path, fields in ((CHAT, CHAT_FIELDS), (COMPLETIONS, COMPLETION_FIELDS)):
        fields = {**fields, "messages": [{"role": "user", "content": "Hi", "name": "n"}]} if path == CHAT else fields
        for surrogate in SURROGATES[:2]:
            for body in _with_string(fields, surrogate):
                yield post(path, body)  # json.dumps escapes it: "\ud800", valid JSON text that decodes to it
    for surrogate in SURROGATES:
        yield post(COMPLETIONS, completion(prompt=["ok", surrogate]))
        yield post(CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": surrogate}]}]))
        yield post(f"/models/{MODEL}/v1/completions", {"prompt": surrogate})


def huge_numbers() -> Iterator[Request]:
    numbers = ["1e308", "-1e308", "1e999", "-1e999", str(2**63), str(2**64), str(-(2**63) - 1), "1" + "0" * 5000,
               "0." + "0" * 5000 + "1", "NaN", "Infinity", "-Infinity", "1E400", "123456789012345678901234567890"]
    fields = ["max_tokens", "temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty", "top_k",
              "min_p", "repetition_penalty", "min_tokens", "logprobs", "top_logprobs", "max_completion_tokens"]
    for field in fields:
        for number in numbers:
            yield post(COMPLETIONS, f'{{"model":"{MODEL}","prompt":"x","{field}":{number}}}'.encode())
            limit = "" if "max" in field else '"max_tokens":4,'  # chat has no default limit: the whole context
            yield post(CHAT, f'{{"model":"{MODEL}","messages":[{{"role":"user","content":"x"}}],{limit}'
                             f'"{field}":{number}}}'.encode())
    yield post(COMPLETIONS, f'{{"model":"{MODEL}","prompt":[{"9" * 5000}]}}'.encode())
    yield post(COMPLETIONS, f'{{"model":"{MODEL}","prompt":"x","logit_bias":{{"1":1e999}}}}'.encode())


def output_limits() -> Iterator[Request]:
    for limit in (-(2**63), -1, 0, 2048, 2049, 2**31, 2**63, 10**6):
        yield from both(max_tokens=limit)
        yield post(CHAT, chat(max_completion_tokens=limit))
        yield from both(min_tokens=limit)
        yield from both(max_tokens=4, min_tokens=limit)
    yield post(COMPLETIONS, completion(prompt="x " * 3000, max_tokens=4))


def wrong_types() -> Iterator[Request]:
    for path, fields in ((CHAT, CHAT_FIELDS), (COMPLETIONS, COMPLETION_FIELDS)):
        for field in fields:
            for value in WRONG_TYPES:
                yield post(path, {**fields, field: value})
    for value in WRONG_TYPES:
        yield post(CHAT, chat(messages=[value]))
        yield post(CHAT, chat(messages=[{"role": value, "content": "x"}]))
        yield post(CHAT, chat(messages=[{"role": "user", "content": value}]))
        yield post(CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": value}]}]))
        yield post(CHAT, chat(tools=[{"type": "function", "function": {"name": value}}], tool_choice="auto"))
        yield post(CHAT, chat(stream=True, stream_options={"include_usage": value}))
    for body in (None, True, 1, "x", [], [{}], {}):
        yield post(CHAT, body)
        yield post(COMPLETIONS, body)


def token_ids_out_of_range() -> Iterator[Request]:
    for token in (VOCAB, VOCAB + 1, 10**9, 2**31, 2**32, 2**63, 2**64, -1, -(2**63)):
        yield post(COMPLETIONS, completion(prompt=[1, token]))
        yield post(COMPLETIONS, completion(prompt=[[1, 2], [token]]))
        # Past one KV block (16 tokens): the gateway hashes full blocks of a prompt to route it, before any replica.
        yield post(COMPLETIONS, completion(prompt=[1] * 32 + [token]))
        yield post(COMPLETIONS, completion(prompt=[[token] * 40, [1]]))
        yield from both(stop_token_ids=[token])
        yield from both(stop_token_ids=[token], min_tokens=2, max_tokens=4)  # the sampler's mask (issue 13, 2.)
        yield from both(logit_bias={str(token): 1})
    for key in ("abc", "", "1.5", " 1", "1e3", "\u0661"):  # not token ids at all ("\u0661" is Arabic-Indic one)
        yield from both(logit_bias={key: 1})


def huge_prompt_lists() -> Iterator[Request]:
    yield post(COMPLETIONS, completion(prompt=["x"] * 2_500, max_tokens=1))
    yield post(COMPLETIONS, completion(prompt=[[1]] * 2_500, max_tokens=1))
    yield post(COMPLETIONS, completion(prompt=[1] * 100_000, max_tokens=1))
    yield post(CHAT, chat(messages=[{"role": "user", "content": "x"}] * 10_000, max_tokens=1))
    yield post(CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 10_000}]))
    yield from both(stop=["x"] * 10_000)
    yield from both(stop_token_ids=[1] * 100_000)


def invalid_utf8() -> Iterator[Request]:
    for raw in (b"\xff\xfe", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf", b"\x80"):
        yield post(COMPLETIONS, b'{"model":"' + MODEL.encode() + b'","prompt":"' + raw + b'"}')
        yield post(CHAT, b'{"model":"' + raw + b'","messages":[]}')
        yield post(CHAT, raw)
    yield post(COMPLETIONS, "\ufeff".encode() + json.dumps(completion()).encode())  # a BOM first
    yield post(COMPLETIONS, json.dumps(completion()).encode("utf-16"))
    yield post(COMPLETIONS, b"")
    yield post(COMPLETIONS, b"\x00" * 100)


def content_types() -> Iterator[Request]:
    body = json.dumps(completion()).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "application/json; charset=latin-1", "application/xml", "", "\x7f"):
        yield "POST", COMPLETIONS, {"Content-Type": content_type}, body
        yield "POST", CHAT, {"Content-Type": content_type}, b"model=tiny-llama&prompt=x"
    yield "POST", COMPLETIONS, {"Content-Type": "application/json", "Content-Encoding": "gzip"}, body
    yield "POST", COMPLETIONS, {"Content-Type": "multipart/form-data; boundary=x"}, (
        b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx\r\n--x--\r\n')


def oversized_bodies() -> Iterator[Request]:
    filler = "x" * (48 * 1024 * 1024)  # past the gateway's 32 MiB
    yield post(COMPLETIONS, completion(prompt=filler))
    yield post(CHAT, chat(user=filler))


def odd_routes() -> Iterator[Request]:
    body = json.dumps(completion()).encode()
    for method, path in (("GET", COMPLETIONS), ("PUT", CHAT), ("DELETE", "/v1/models"), ("PATCH", "/health"),
                         ("GET", "/models/%00/info"), ("GET", "/models/..%2f..%2fetc/info"),
                         ("GET", f"/models/{'x' * 10_000}/info"), ("POST", "/models/%ff/v1/completions"),
                         ("POST", "/models/tiny-llama:/v1/completions"), ("GET", "/v1/models/../../admin"),
                         ("GET", "/models/tiny-llama/v1/models"), ("OPTIONS", COMPLETIONS), ("GET", "/nope")):
        yield method, path, {"Content-Type": "application/json"}, body
    yield post(PER_MODEL_COMPLETIONS, {"model": "other", "prompt": "x", "max_tokens": 1})
    yield post(PER_MODEL_CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    for model in ("", ":", "tiny-llama:", ":x", "tiny-llama:nope", "x" * 100_000, "tiny-llama\x00", "../x"):
        yield from both(model=model)


CLASSES = {
    "deep nesting": deep_nesting, "lone surrogates in every string field": lone_surrogates,
    "huge numbers": huge_numbers, "negative and oversized output limits": output_limits,
    "wrong types at every field": wrong_types, "token ids out of range": token_ids_out_of_range,
    "huge prompt lists": huge_prompt_lists, "invalid UTF-8": invalid_utf8, "wrong content types": content_types,
    "oversized bodies": oversized_bodies, "odd routes and model names": odd_routes,
}


@pytest.mark.parametrize("name", list(CLASSES))
def test_hostile_class_gets_openai_errors_and_no_5xx(name: str, gateway: Any, campaign: Any,
                                                     assert_healthy: Any) -> None:
    run = campaign(f"http-hostile: {name}")
    with httpx.Client(base_url=gateway.url, headers=gateway.auth, timeout=60) as client:
        for method, path, headers, body in CLASSES[name]():
            what = f"{method} {path} {body[:200]!r}"
            try:
                response = client.request(method, path, headers=headers, content=body)
            except httpx.HTTPError as e:
                run.record_transport_error(e, what)
                continue
            run.record(response.status_code, response.headers, response.content, what)
    summary = run.report()
    assert_healthy(gateway)
    assert not summary["violations"], json.dumps(summary["violations"], indent=1)[:4000]


def test_headers_that_are_not_latin_1_or_too_long_get_answers(gateway: Any, campaign: Any,
                                                              assert_healthy: Any) -> None:
    run = campaign("http-hostile: odd headers")
    body = json.dumps(completion()).encode()
    cases = [[(b"authorization", b"Bearer \xff\xfe")], [(b"authorization", b"Bearer " + b"k" * 60_000)],
             [(b"authorization", b"Basic " + gateway.api_key.encode())], [(b"authorization", b"Bearer")],
             [(b"authorization", b"")], [(b"x-request-id", b"\xff" * 100)], [(b"x-request-id", b"r" * 60_000)]]
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        for headers in cases:
            auth = [] if headers[0][0] == b"authorization" else [(b"authorization", gateway.auth["Authorization"]
                                                                   .encode())]
            try:
                response = client.post(COMPLETIONS, headers=[*auth, *headers,
                                                             (b"content-type", b"application/json")], content=body)
            except httpx.HTTPError as e:
                run.record_transport_error(e, repr(headers)[:200])
                continue
            run.record(response.status_code, response.headers, response.content, repr(headers)[:200])
    summary = run.report()
    assert_healthy(gateway)
    assert not summary["violations"], json.dumps(summary["violations"], indent=1)[:4000]
