"""Chat requests with tools: bad tool definitions and choices are 400s naming the field; good ones resolve to the
ToolUse the replica serves (which tools, constrained or not, one call or several)."""

from __future__ import annotations

from typing import Any

import pytest

from ember_platform.gateway.errors import ProtocolError
from ember_platform.gateway.protocol import parse_chat_request
from ember_platform.tools import Tool, ToolUse

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PING = {"type": "function", "function": {"name": "ping"}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def with_parameters(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize(("body", "param", "fragment"), [
    (chat(tools=[with_parameters({"type": "objekt"})]), "tools[0].function.parameters", "not a valid JSON schema"),
    (chat(tools=[with_parameters({"type": "object", "properties": {"a": {"minimum": "1"}}})]),
     "tools[0].function.parameters", "at '.properties.a.minimum'"),
    (chat(tools=[with_parameters({"type": "object", "required": "city"})]), "tools[0].function.parameters",
     "not a valid JSON schema"),
    (chat(tools=[with_parameters({"type": "string"})]), "tools[0].function.parameters", "must be 'object'"),
    (chat(tools=[with_parameters([1])]), "tools[0].function.parameters", "valid dictionary"),
    (chat(tools=[with_parameters({"$schema": 5})]), "tools[0].function.parameters", "must be a URI string"),
    (chat(tools=[with_parameters({"type": "object", "properties": {"a": {"pattern": "["}}})]),
     "tools[0].function.parameters", "'[' is not a 'regex' (at '.properties.a.pattern')"),
    (chat(tools=[WEATHER, {"type": "function", "function": {"name": "has space"}}]), "tools[1].function.name",
     "1 to 64 letters"),
    (chat(tools=[WEATHER, WEATHER]), "tools[1].function.name", "two tools are named 'get_weather'"),
    (chat(tools=[WEATHER], tool_choice=named("get_time")), "tool_choice.function.name",
     "'get_time' is not among the tools (get_weather)"),
    (chat(tool_choice="required"), "tool_choice", "only allowed when 'tools'"),
    (chat(tool_choice=named("get_weather")), "tool_choice", "only allowed when 'tools'"),
    (chat(parallel_tool_calls=False), "parallel_tool_calls", "only allowed when 'tools'"),
    (chat(tools=[]), "tools", "only allowed when 'tools' lists at least one tool"),
    (chat(tools=[WEATHER], logprobs=True), "logprobs", "not supported together with tools"),
    (chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "also constrains its output with 'response_format'"),
    (chat(tools=[{**WEATHER, "function": {**WEATHER["function"], "strict": True}}],
          response_format={"type": "json_object"}), "tool_choice", "strict tools constrain the calls"),
])
def test_bad_tool_requests_are_400s_naming_the_field(body: dict[str, Any], param: str, fragment: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_chat_request(body)
    error = caught.value
    assert (error.status, error.param) == (400, param), error.body()
    assert fragment in str(error.body()["error"]["message"]), error.body()


def test_tool_choice_resolves_to_what_the_replica_serves() -> None:
    weather = Tool("get_weather", "Weather in a city", WEATHER["function"]["parameters"])
    ping = Tool("ping")
    both = [WEATHER, PING]
    assert parse_chat_request(chat()).tool_use() is None
    assert parse_chat_request(chat(tools=both, tool_choice="none")).tool_use() is None
    assert parse_chat_request(chat(tools=both, tool_choice="none", logprobs=True)).tool_use() is None
    assert parse_chat_request(chat(tools=both)).tool_use() == ToolUse((weather, ping), "auto", parallel=True)
    assert parse_chat_request(chat(tools=both, tool_choice="required", parallel_tool_calls=False)).tool_use() == \
        ToolUse((weather, ping), "required", parallel=False)
    only_ping = parse_chat_request(chat(tools=both, tool_choice=named("ping"))).tool_use()
    assert only_ping == ToolUse((ping,), "named", parallel=False) and only_ping.constrained
    assert ping.arguments_schema() == {"type": "object", "properties": {}, "additionalProperties": False}
    strict = {**PING, "function": {**PING["function"], "strict": True}}
    use = parse_chat_request(chat(tools=[WEATHER, strict])).tool_use()
    assert use is not None and use.strict and not use.constrained and use.tools[1] == Tool("ping", strict=True)
    # a strict tool with response_format json_object is fine once the model is not offered the tools
    assert parse_chat_request(chat(tools=[strict], tool_choice="none", response_format={"type": "json_object"}))


def test_assistant_tool_calls_reach_the_template_with_their_arguments_as_objects() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    odd = {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    request = parse_chat_request(chat(messages=[
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call, odd]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}], tools=[WEATHER]))
    calls = request.template_messages()[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}
    assert calls[1] == odd  # not JSON: passed as sent, for the template to write as text
