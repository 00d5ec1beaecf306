"""Responses and stream chunks: exactly OpenAI's objects, accepted by the official `openai` types and client."""

from __future__ import annotations

import ast
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ember_platform.gateway.errors import ProtocolError
from ember_platform.gateway.protocol import parse_chat_request, parse_completion_request
from ember_platform.gateway.responses import (
    SSE_DONE,
    UNLIKELY_LOGPROB,
    ChatStream,
    CompletionStream,
    Generation,
    chat_completion,
    sse,
    text_completion,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
ENGINE = REPO_ROOT / "platform" / "ember_platform" / "engine"


# Stand-ins for the engine's RequestOutput, Usage and TokenLogprobs: the real ones live in modules that import
# torch, which this layer must not need. test_fakes_have_the_engines_fields keeps them in step.
@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclasses.dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    usage: Usage
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None


VOCAB = {0: "Hello", 1: ",", 2: " world", 3: "!", 4: "é", 5: "<0xC3>", 6: "Hi"}
ID, CREATED, MODEL = "chatcmpl-test", 1_700_000_000, "tiny"


def token_text(token_id: int) -> str:
    return VOCAB[token_id]


def step(ids: list[int], text: str, completion_tokens: int, finish_reason: str | None = None,
         logprobs: list[TokenLogprobs] | None = None, prompt_tokens: int = 5, cached: int = 0) -> RequestOutput:
    return RequestOutput("r1", ids, text, finish_reason is not None, finish_reason, None,
                         Usage(prompt_tokens, completion_tokens, cached), logprobs)


# "Hello, world!" in four engine steps: one token; two at once (speculation); one whose text the detokenizer
# holds back; the last one, with the finish.
STEPS = [
    step([0], "Hello", 1),
    step([1, 2], ", world", 3),
    step([5], "", 4),
    step([3], "!", 5, "stop", cached=2),
]


def _field_names(path: Path, class_name: str) -> list[str]:
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


@pytest.mark.parametrize(("fake", "path"), [
    (RequestOutput, ENGINE / "outputs.py"), (Usage, ENGINE / "outputs.py"), (TokenLogprobs, ENGINE / "sampler.py")])
def test_fakes_have_the_engines_fields(fake: type, path: Path) -> None:
    assert [f.name for f in dataclasses.fields(fake)] == _field_names(path, fake.__name__)


def test_a_chat_completion_is_exactly_openais_object() -> None:
    body = chat_completion(Generation.collect(STEPS), model=MODEL, token_text=token_text, completion_id=ID,
                           created=CREATED)
    assert body == {
        "id": ID,
        "object": "chat.completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello, world!"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                  "prompt_tokens_details": {"cached_tokens": 2}},
    }
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Hello, world!"
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_chat_logprobs_are_in_openais_format_with_bytes_and_no_infinities() -> None:
    steps = [step([4], "é", 1, logprobs=[TokenLogprobs(4, -0.25, [(4, -0.25), (6, -1.5)])]),
             step([3], "!", 2, "length", logprobs=[TokenLogprobs(3, float("-inf"), [(0, -0.1), (3, float("-inf"))])])]
    body = chat_completion(Generation.collect(steps), model=MODEL, token_text=token_text, logprobs=True,
                           completion_id=ID, created=CREATED)
    assert body["choices"][0]["logprobs"] == {"content": [
        {"token": "é", "logprob": -0.25, "bytes": [195, 169], "top_logprobs": [
            {"token": "é", "logprob": -0.25, "bytes": [195, 169]},
            {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]}]},
        {"token": "!", "logprob": UNLIKELY_LOGPROB, "bytes": [33], "top_logprobs": [
            {"token": "Hello", "logprob": -0.1, "bytes": [72, 101, 108, 108, 111]},
            {"token": "!", "logprob": UNLIKELY_LOGPROB, "bytes": [33]}]},
    ]}
    assert body["choices"][0]["finish_reason"] == "length"
    json.dumps(body, allow_nan=False)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].token == "Hi"


def test_chat_logprobs_with_no_alternatives_have_empty_top_logprobs() -> None:
    steps = [step([6], "Hi", 1, "stop", logprobs=[TokenLogprobs(6, -0.5, [])])]
    body = chat_completion(Generation.collect(steps), model=MODEL, token_text=token_text, logprobs=True)
    assert body["choices"][0]["logprobs"] == {
        "content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]}
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)


def test_a_text_completion_has_one_choice_per_prompt_and_summed_usage() -> None:
    first = [step([0], "Hello", 1), step([3], "!", 2, "stop", prompt_tokens=4, cached=1)]
    second = [step([6], "Hi", 1, "length", prompt_tokens=3)]
    body = text_completion([Generation.collect(first), Generation.collect(second)], model=MODEL,
                           token_text=token_text, completion_id="cmpl-test", created=CREATED)
    assert body == {
        "id": "cmpl-test",
        "object": "text_completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [{"text": "Hello!", "index": 0, "logprobs": None, "finish_reason": "stop"},
                    {"text": "Hi", "index": 1, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                  "prompt_tokens_details": {"cached_tokens": 1}},
    }
    assert Completion.model_validate(body).choices[1].text == "Hi"


def test_completion_logprobs_have_tokens_offsets_and_top_dicts_that_include_the_sampled_token() -> None:
    steps = [step([0], "Hello", 1, logprobs=[TokenLogprobs(0, -0.1, [(6, -0.05), (0, -0.1)])]),
             step([1, 2], ", world", 3, "stop",
                  logprobs=[TokenLogprobs(1, -0.2, [(3, -0.15)]), TokenLogprobs(2, -0.3, [(2, -0.3)])])]
    body = text_completion([Generation.collect(steps)], model=MODEL, token_text=token_text, logprobs=True,
                           completion_id="cmpl-test", created=CREATED)
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Hello", ",", " world"],
        "token_logprobs": [-0.1, -0.2, -0.3],
        "top_logprobs": [{"Hi": -0.05, "Hello": -0.1}, {"!": -0.15, ",": -0.2}, {" world": -0.3}],
        "text_offset": [0, 5, 6],
    }
    assert Completion.model_validate(body).choices[0].logprobs.tokens == ["Hello", ",", " world"]


def test_an_aborted_request_has_no_successful_response() -> None:
    aborted = [step([0], "Hello", 1), step([], "", 1, "abort")]
    with pytest.raises(ProtocolError) as info:
        chat_completion(Generation.collect(aborted), model=MODEL, token_text=token_text)
    assert info.value.status == 503 and info.value.code == "request_aborted"
    with pytest.raises(ProtocolError):
        text_completion([Generation.collect(aborted)], model=MODEL, token_text=token_text)


def chat_chunk(delta: dict[str, Any] | None, finish_reason: str | None = None, logprobs: Any = None,
               **usage: Any) -> dict[str, Any]:
    choices = [] if delta is None else [
        {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    return {"id": ID, "object": "chat.completion.chunk", "created": CREATED, "model": MODEL, "choices": choices,
            **usage}


def run_chat_stream(steps: list[RequestOutput], **options: Any) -> list[dict[str, Any]]:
    stream = ChatStream(model=MODEL, token_text=token_text, completion_id=ID, created=CREATED, **options)
    chunks = [chunk for output in steps for chunk in stream.add(output)]
    assert stream.done
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    return chunks


def test_a_chat_stream_is_openais_chunk_sequence() -> None:
    assert run_chat_stream(STEPS) == [
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"content": "Hello"}),
        chat_chunk({"content": ", world"}),
        chat_chunk({"content": "!"}),
        chat_chunk({}, "stop"),
    ]


def test_a_chat_stream_with_include_usage_ends_with_a_usage_chunk_and_has_null_usage_before() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 2}}
    assert run_chat_stream(STEPS, include_usage=True) == [
        chat_chunk({"role": "assistant", "content": ""}, usage=None),
        chat_chunk({"content": "Hello"}, usage=None),
        chat_chunk({"content": ", world"}, usage=None),
        chat_chunk({"content": "!"}, usage=None),
        chat_chunk({}, "stop", usage=None),
        chat_chunk(None, usage=usage),
    ]


def test_a_chat_stream_carries_each_steps_logprobs_with_its_content() -> None:
    steps = [step([0], "Hello", 1, logprobs=[TokenLogprobs(0, -0.1, [])]),
             step([5], "", 2, logprobs=[TokenLogprobs(5, -0.2, [])]),
             step([3], "!", 3, "length", logprobs=[TokenLogprobs(3, -0.3, [(3, -0.3)])])]
    assert run_chat_stream(steps, logprobs=True) == [
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"content": "Hello"}, logprobs={"content": [
            {"token": "Hello", "logprob": -0.1, "bytes": [72, 101, 108, 108, 111], "top_logprobs": []}]}),
        # No text yet, but a token was sampled: its logprob is not dropped.
        chat_chunk({"content": ""}, logprobs={"content": [
            {"token": "<0xC3>", "logprob": -0.2, "bytes": [60, 48, 120, 67, 51, 62], "top_logprobs": []}]}),
        chat_chunk({"content": "!"}, logprobs={"content": [
            {"token": "!", "logprob": -0.3, "bytes": [33], "top_logprobs": [
                {"token": "!", "logprob": -0.3, "bytes": [33]}]}]}),
        chat_chunk({}, "length"),
    ]


def test_a_chat_stream_can_send_its_role_chunk_before_the_first_token() -> None:
    stream = ChatStream(model=MODEL, token_text=token_text, completion_id=ID, created=CREATED)
    assert stream.start() == [chat_chunk({"role": "assistant", "content": ""})]
    assert stream.start() == []
    assert stream.add(step([6], "Hi", 1, "stop")) == [chat_chunk({"content": "Hi"}), chat_chunk({}, "stop")]
    with pytest.raises(RuntimeError):
        stream.add(step([6], "Hi", 1, "stop"))


def test_an_aborted_stream_ends_with_an_openai_error_event() -> None:
    stream = ChatStream(model=MODEL, token_text=token_text, completion_id=ID, created=CREATED)
    chunks = stream.add(step([0], "Hello", 1)) + stream.add(step([], "", 1, "abort"))
    assert chunks[-1] == {"error": {"message": "The request was aborted before it finished. Please retry it.",
                                    "type": "service_unavailable", "param": None, "code": "request_aborted"}}
    assert stream.done


def completion_chunk(choice: dict[str, Any] | None, **usage: Any) -> dict[str, Any]:
    return {"id": "cmpl-test", "object": "text_completion", "created": CREATED, "model": MODEL,
            "choices": [] if choice is None else [choice], **usage}


def validate_completion_chunk(chunk: dict[str, Any]) -> None:
    # OpenAI's client builds stream chunks without validation, and `Completion` says finish_reason is never null:
    # that is the only complaint it may have about a chunk before the last.
    try:
        Completion.model_validate(chunk)
    except ValueError as e:
        errors = e.errors()  # type: ignore[attr-defined]
        assert [err["loc"][-1] for err in errors] == ["finish_reason"] and chunk["choices"][0]["finish_reason"] is None


def test_a_completion_stream_is_openais_chunk_sequence_with_continuing_text_offsets() -> None:
    steps = [step([0], "Hello", 1, logprobs=[TokenLogprobs(0, -0.1, [])]),
             step([1, 2], ", world", 3, logprobs=[TokenLogprobs(1, -0.2, []), TokenLogprobs(2, -0.3, [])]),
             step([3], "!", 4, "stop", logprobs=[TokenLogprobs(3, -0.4, [])])]
    stream = CompletionStream(model=MODEL, token_text=token_text, completion_id="cmpl-test", created=CREATED,
                              logprobs=True, include_usage=True)
    chunks = [chunk for output in steps for chunk in stream.add(output)]
    assert chunks == [
        completion_chunk({"text": "Hello", "index": 0, "finish_reason": None, "logprobs": {
            "tokens": ["Hello"], "token_logprobs": [-0.1], "top_logprobs": [{"Hello": -0.1}], "text_offset": [0]}},
            usage=None),
        completion_chunk({"text": ", world", "index": 0, "finish_reason": None, "logprobs": {
            "tokens": [",", " world"], "token_logprobs": [-0.2, -0.3], "top_logprobs": [{",": -0.2}, {" world": -0.3}],
            "text_offset": [5, 6]}}, usage=None),
        completion_chunk({"text": "!", "index": 0, "finish_reason": None, "logprobs": {
            "tokens": ["!"], "token_logprobs": [-0.4], "top_logprobs": [{"!": -0.4}], "text_offset": [12]}},
            usage=None),
        completion_chunk({"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}, usage=None),
        completion_chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                      "prompt_tokens_details": {"cached_tokens": 0}}),
    ]
    for chunk in chunks:
        validate_completion_chunk(chunk)


def test_a_batched_completion_stream_ends_once_every_prompt_is_done() -> None:
    stream = CompletionStream(model=MODEL, token_text=token_text, completion_id="cmpl-test", created=CREATED,
                              include_usage=True, num_choices=2)
    assert stream.add(step([6], "Hi", 1, "length", prompt_tokens=2), index=1) == [
        completion_chunk({"text": "Hi", "index": 1, "logprobs": None, "finish_reason": None}, usage=None),
        completion_chunk({"text": "", "index": 1, "logprobs": None, "finish_reason": "length"}, usage=None),
    ]
    assert not stream.done
    last = stream.add(step([3], "!", 1, "stop", prompt_tokens=3), index=0)
    assert last[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    assert stream.done
    with pytest.raises(IndexError):
        stream.add(step([3], "!", 1), index=2)


def test_sse_frames_compact_utf8_json_and_done() -> None:
    assert sse({"text": "é", "n": [1, 2]}) == 'data: {"text":"é","n":[1,2]}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        sse({"logprob": float("-inf")})


def client_answering(respond: Callable[[dict[str, Any]], httpx.Response]) -> openai.OpenAI:
    """The official client, wired to answer each request with `respond(body)` instead of a network call."""
    def handler(request: httpx.Request) -> httpx.Response:
        return respond(json.loads(request.content))
    return openai.OpenAI(api_key="sk-test", base_url="http://ember.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def sse_response(chunks: list[dict[str, Any]]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content=b"".join(map(sse, chunks)) + SSE_DONE)


def test_the_official_client_round_trips_a_chat_completion_and_a_stream() -> None:
    def respond(body: dict[str, Any]) -> httpx.Response:
        request = parse_chat_request(body)
        params = request.sampling_params_for(num_prompt_tokens=5, max_model_len=64)
        assert (params.temperature, params.top_k, params.max_tokens, params.logprobs) == (0.0, 5, 20, 2)
        if not request.stream:
            return httpx.Response(200, json=chat_completion(
                Generation.collect(STEPS), model=request.model, token_text=token_text, logprobs=False))
        stream = ChatStream(model=request.model, token_text=token_text, include_usage=request.include_usage)
        return sse_response([chunk for output in STEPS for chunk in stream.add(output)])

    client = client_answering(respond)
    kwargs: dict[str, Any] = {"model": "tiny:sql", "messages": [{"role": "user", "content": "Hi"}],
                              "temperature": 0, "max_completion_tokens": 20, "logprobs": True, "top_logprobs": 2,
                              "extra_body": {"top_k": 5}}
    answer = client.chat.completions.create(**kwargs)
    assert answer.choices[0].message.content == "Hello, world!" and answer.usage.total_tokens == 10

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world!"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_the_official_client_raises_an_error_event_and_a_400() -> None:
    def respond(body: dict[str, Any]) -> httpx.Response:
        try:
            request = parse_completion_request(body)
        except ProtocolError as e:
            return httpx.Response(e.status, json=e.body(), headers=e.headers())
        stream = CompletionStream(model=request.model, token_text=token_text)
        return sse_response(stream.add(step([0], "Hello", 1)) + stream.add(step([], "", 1, "abort")))

    client = client_answering(respond)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="Hi", top_p=0)
    assert bad.value.param == "top_p" and bad.value.code == "invalid_value"

    events = client.completions.create(model="tiny", prompt="Hi", stream=True)
    assert next(events).choices[0].text == "Hello"
    with pytest.raises(openai.APIError, match="aborted"):
        next(events)


# --- several choices per prompt (n, best_of, echo) ------------------------------------------------------------------


def generation(text: str, logprob: float, completion_tokens: int, prompt_tokens: int = 5,
               cached: int = 0) -> Generation:
    return Generation.collect([step([6] * completion_tokens, text, completion_tokens, "length",
                                    logprobs=[TokenLogprobs(6, logprob, [])] * completion_tokens,
                                    prompt_tokens=prompt_tokens, cached=cached)])


def test_n_chat_choices_are_numbered_and_count_their_prompt_once() -> None:
    body = chat_completion([generation("a", -1, 2), generation("b", -1, 3, cached=4)], model=MODEL,
                           token_text=token_text)
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(0, "a"), (1, "b")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # choice 0 computed the prompt
    ChatCompletion.model_validate(body)


def test_best_of_keeps_each_prompts_most_likely_candidates_and_bills_them_all() -> None:
    # Two prompts, three candidates each (cumulative logprobs -2, -0.5, -3 and -1, -4, -0.25), n = 2.
    candidates = [generation("p0a", -1.0, 2), generation("p0b", -0.25, 2), generation("p0c", -1.5, 2),
                  generation("p1a", -0.5, 2, prompt_tokens=7), generation("p1b", -2.0, 2, prompt_tokens=7),
                  generation("p1c", -0.125, 2, prompt_tokens=7)]
    body = text_completion(candidates, model=MODEL, token_text=token_text, candidates=3, n=2,
                           echo=["P0:", "P1:"])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "P0:p0b"), (1, "P0:p0a"), (2, "P1:p1c"),
                                                                  (3, "P1:p1a")]
    assert body["usage"]["prompt_tokens"] == 12 and body["usage"]["completion_tokens"] == 12
    Completion.model_validate(body)


def test_streams_of_n_choices_send_a_role_chunk_each_and_echo_the_prompt_first() -> None:
    chat_stream = ChatStream(model=MODEL, token_text=token_text, completion_id=ID, created=CREATED, n=2,
                             include_usage=True)
    chunks = chat_stream.add(step([0], "Hello", 1, "stop"), 1)
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 1, 1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and not chat_stream.done
    chunks = chat_stream.add(step([0], "Hello", 1, "stop"), 0)
    assert chat_stream.done and chunks[-1]["usage"]["prompt_tokens"] == 5  # once for the two choices
    with pytest.raises(IndexError):
        ChatStream(model=MODEL, token_text=token_text, n=2).add(step([0], "Hello", 1), 2)
    stream = CompletionStream(model=MODEL, token_text=token_text, completion_id=ID, created=CREATED, num_choices=2,
                              n=2, echo=["Say: ", "Say: "])
    texts = [c["choices"][0]["text"] for c in stream.add(step([5], "", 1), 0) + stream.add(step([0], "Hi", 2), 0)
             + stream.add(step([3], "!", 1, "stop"), 1)]
    assert texts == ["Say: ", "Hi", "Say: !", ""]


def test_echo_with_logprobs_leads_with_the_prompts_tokens_the_first_one_null() -> None:
    prompt_lps = [TokenLogprobs(2, -0.5, [(1, -0.25)])]  # the prompt is "Hello world": token 0, then token 2
    out = dataclasses.replace(step([3], "!", 1, "stop", logprobs=[TokenLogprobs(3, -0.125, [])]),
                              prompt_logprobs=prompt_lps)
    body = text_completion([Generation.collect([out])], model=MODEL, token_text=token_text, logprobs=True,
                           echo=["Hello world"], echo_first_tokens=[0])
    expected = {"tokens": ["Hello", " world", "!"], "token_logprobs": [None, -0.5, -0.125],
                "top_logprobs": [None, {",": -0.25, " world": -0.5}, {"!": -0.125}], "text_offset": [0, 5, 11]}
    assert body["choices"][0]["text"] == "Hello world!" and body["choices"][0]["logprobs"] == expected
    # (The openai package types the lists without null, but its client does not validate responses: the test through
    # `ember serve` reads this null with it. OpenAI's legacy API and vLLM send it for the prompt's first token.)
    stream = CompletionStream(model=MODEL, token_text=token_text, logprobs=True, completion_id=ID, num_choices=1,
                              echo=["Hello world"], echo_first_tokens=[0])
    chunks = stream.add(out, 0)
    assert chunks[0]["choices"][0]["text"] == "Hello world!" and chunks[0]["choices"][0]["logprobs"] == expected


def test_chat_logprobs_bytes_are_the_tokens_own_when_it_holds_part_of_a_character() -> None:
    raw = {5: b"\xc3", 4: b"\xa9"}  # "é" in two byte-level tokens, each alone decoding to U+FFFD
    steps = [step([5, 4], "é", 2, "stop", logprobs=[TokenLogprobs(5, -0.5, [(5, -0.5)]), TokenLogprobs(4, -0.1, [])])]
    body = chat_completion(Generation.collect(steps), model=MODEL, token_text=lambda i: "\ufffd", logprobs=True,
                           token_bytes=raw.__getitem__)
    content = body["choices"][0]["logprobs"]["content"]
    assert [t["bytes"] for t in content] == [[0xC3], [0xA9]] and content[0]["top_logprobs"][0]["bytes"] == [0xC3]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "é"
    stream = ChatStream(model=MODEL, token_text=lambda i: "\ufffd", logprobs=True, token_bytes=raw.__getitem__)
    chunk = next(c for c in stream.add(steps[0]) if c["choices"][0]["logprobs"])
    assert [t["bytes"] for t in chunk["choices"][0]["logprobs"]["content"]] == [[0xC3], [0xA9]]
