"""chat.completion objects and chunks with tool calls, exactly as OpenAI writes them (checked by the openai
package's own types too)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ember.plugins import PluginHost
from ember_platform.gateway.responses import ChatStream, Generation, chat_completion

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def hermes() -> Any:
    technique = PluginHost().techniques.get("tool_parser", "hermes")
    assert technique is not None
    return technique.load()()


def output(text: str, finish_reason: str | None = None, tokens: int = 1) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", new_token_ids=[0] * tokens, new_text=text,
                           finished=finish_reason is not None, finish_reason=finish_reason, stop_reason=None,
                           logprobs=None,
                           usage=SimpleNamespace(prompt_tokens=5, completion_tokens=tokens, cached_tokens=0))


def test_a_whole_response_with_a_call_has_null_content_and_finishes_with_tool_calls() -> None:
    generation = Generation.collect([output(CALL, "stop")])
    response = chat_completion(generation, model="m", token_text=str, completion_id="chatcmpl-1", created=1,
                               tool_parser=hermes())
    ChatCompletion.model_validate(response)
    choice = response["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call == {
        "id": call["id"], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    # cut off by max_tokens: the call as far as it got, and the finish_reason says so
    cut = chat_completion(Generation.collect([output(CALL[:60], "length")]), model="m", token_text=str,
                          tool_parser=hermes())
    assert cut["choices"][0]["finish_reason"] == "length"
    # without a call, the text as it is
    plain = chat_completion(Generation.collect([output("Hi there", "stop")]), model="m", token_text=str,
                            tool_parser=hermes())
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}


def test_a_streamed_call_is_an_opening_delta_then_argument_fragments() -> None:
    stream = ChatStream(model="m", token_text=str, completion_id="chatcmpl-1", created=1, tool_parser=hermes())
    pieces = ["Sure.\n", CALL[:40], CALL[40:70], CALL[70:]]
    chunks = [c for piece in pieces for c in stream.add(output(piece))] + stream.add(output("", "stop"))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    choices = [c["choices"][0] for c in chunks]
    assert [c["delta"] for c in choices[:2]] == [{"role": "assistant", "content": ""}, {"content": "Sure."}]
    opening = choices[2]["delta"]["tool_calls"][0]
    assert opening == {"index": 0, "id": opening["id"], "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}}
    fragments = [c["delta"]["tool_calls"][0] for c in choices[3:-1]]
    assert all(set(f) == {"index", "function"} and f["index"] == 0 for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"city": "Paris"}'
    assert choices[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert all(c["finish_reason"] is None for c in choices[:-1])
