"""Tool calling end to end: `ember serve` (gateway, control plane, replica processes) and the official OpenAI client.

tiny-llama's chat template renders tools as Qwen2.5 does and its package names the `hermes` parser. The 5M model has
never seen a tool call, so `tool_choice` "required" / a named function (constrained by a grammar) is what makes it
call one; `auto` parsing is covered per parser in tests/plugins/test_tool_parsers.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-llama"
MODEL, PLAIN = "tiny-llama", "tiny-plain"  # the second: the same model with [chat] tool_parser = "none"
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}
PRIME_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city for some days",
                                           "parameters": CITY_SCHEMA}},
         {"type": "function", "function": {"name": "is_prime", "description": "Whether n is prime",
                                           "parameters": PRIME_SCHEMA}}]
SCHEMAS = {"get_weather": CITY_SCHEMA, "is_prime": PRIME_SCHEMA}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ADMIN_KEY = "ember-sk-admin-for-tool-tests"


class Served:
    def __init__(self, url: str, api_key: str) -> None:
        self.url, self.api_key = url, api_key

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0, timeout=120)


def ember(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, stop_serve: Callable[..., None],
           serve_ready_url: Callable[..., str]) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("tools")
    plain = Path(shutil.copytree(EXAMPLE, tmp / PLAIN, ignore=shutil.ignore_patterns("__pycache__", "ember.lock")))
    manifest = (plain / "ember.toml").read_text()
    assert 'tool_parser = "hermes"' in manifest
    (plain / "ember.toml").write_text(manifest.replace(f'name = "{MODEL}"', f'name = "{PLAIN}"', 1)
                                      .replace('tool_parser = "hermes"', 'tool_parser = "none"'))
    env = {**os.environ, "EMBER_HOME": str(tmp / "home"), "EMBER_REGISTRY": str(tmp / "registry"),
           "EMBER_CACHE": str(tmp / "cache"), "EMBER_ADMIN_KEY": ADMIN_KEY, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    created = ember("keys", "create", "--name", "tests", env=env)
    assert created.returncode == 0, created.stderr
    log = tmp / "serve.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(EXAMPLE), str(plain), "--port", "0"],
                                   env=env, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO)
    pids: set[int] = set()
    server = Served("", created.stdout.strip())
    try:
        server.url = serve_ready_url(process, log, 180)
        yield server
    finally:
        if server.url:  # the replicas' pids, for stop_serve to kill any that outlive the gateway
            for name in (MODEL, PLAIN):
                deployment = httpx.get(f"{server.url}/admin/deployments/{name}", timeout=30,
                                       headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
                pids |= {r["pid"] for r in deployment.get("replicas", []) if r.get("pid")}
        stop_serve(process, pids, tmp / "home")


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    # Room for MAX_PARALLEL_CALLS (8) calls of ~45 tokens: a model that repeats calls ends where the grammar does.
    return client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 512,
                                             **kwargs})


def reassemble(chunks: list[Any]) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, calls and finish_reason of a stream, joined as clients join deltas; each delta's shape checked."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.index == len(calls):
                assert call.id.startswith("call_") and call.type == "function", call
                assert call.function.name and call.function.arguments == "", call
                calls.append([call.function.name, ""])
            else:
                assert call.id is None and call.function.name is None and call.index == len(calls) - 1, call
                calls[-1][1] += call.function.arguments
    return content, [(name, arguments) for name, arguments in calls], finish


def check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_tool_call_round_trip(served: Served) -> None:
    client = served.client()
    first = create(client, tool_choice=NAMED, temperature=1, seed=7)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    check_calls([(call.function.name, call.function.arguments)], {"get_weather"})
    # The assistant message goes back as the client returned it, then the tool's result; the model answers in text.
    messages = [*QUESTION, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12, temperature=0)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # the prompt now holds the call and its result: a longer prompt than the first one
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_a_streamed_round_trip_reassembles_to_the_unstreamed_calls(served: Served) -> None:
    client = served.client()
    for seed in (1, 2, 3):
        whole = create(client, tool_choice="required", temperature=1, seed=seed)
        chunks = list(create(client, tool_choice="required", temperature=1, seed=seed, stream=True))
        content, calls, finish = reassemble(chunks)
        message = whole.choices[0].message
        assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert (content, finish) == ("", "tool_calls") and whole.choices[0].finish_reason == "tool_calls"
        check_calls(calls, set(SCHEMAS))
    # the round trip, streamed: the call's result goes back with the id the stream gave it
    chunks = list(create(client, tool_choice=NAMED, temperature=1, seed=11, stream=True))
    _, [(name, arguments)], _ = reassemble(chunks)
    call_id = next(c.choices[0].delta.tool_calls[0].id for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "22 C and sunny"}]
    content, calls, finish = reassemble(list(client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=12, temperature=0, stream=True)))
    assert content and not calls and finish in ("stop", "length")


def test_required_calls_always_parse_and_follow_their_schemas(served: Served) -> None:
    client = served.client()
    for seed in range(8):
        reply = create(client, tool_choice="required", temperature=1, seed=100 + seed,
                       parallel_tool_calls=seed % 2 == 0)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        check_calls(calls, set(SCHEMAS))
        if seed % 2:
            assert len(calls) == 1


def replica_report(served: Served) -> dict[str, Any]:
    info = httpx.get(f"{served.url}/models/{MODEL}/info", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                     timeout=30).json()
    return info["replica"]


def test_strict_tools_in_auto_mode_constrain_the_calls_and_leave_text_free(served: Served) -> None:
    class IsPrime(pydantic.BaseModel):
        n: int

    tool = openai.pydantic_function_tool(IsPrime)  # strict: true, as the openai package writes it
    assert tool["function"]["strict"] is True
    report = replica_report(served)
    assert report["selections"]["tool_parser"]["name"] == "hermes"
    question = [{"role": "user", "content": "Is 7 prime?"}]

    def masked_rows_for(**kwargs: Any) -> tuple[int, Any]:
        before = replica_report(served)["stats"]["grammar_masked_rows"]
        reply = served.client().chat.completions.create(model=MODEL, messages=question, max_tokens=24,
                                                        temperature=1, seed=5, **kwargs)
        return replica_report(served)["stats"]["grammar_masked_rows"] - before, reply

    unconstrained, _ = masked_rows_for(tools=[{**tool, "function": {**tool["function"], "strict": False}}])
    assert unconstrained == 0  # auto without strict: nothing constrains the model
    masked, reply = masked_rows_for(tools=[tool])
    assert masked >= reply.usage.completion_tokens  # every token drawn under the grammar
    for call in reply.choices[0].message.tool_calls or []:
        IsPrime.model_validate_json(call.function.arguments)


def test_auto_leaves_a_model_that_calls_nothing_with_its_text(served: Served) -> None:
    reply = create(served.client(), max_tokens=8, temperature=0)
    plain = served.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools are in the system prompt


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": {"a": {"type": 7}}}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice.function.name"),
    ({"model": PLAIN}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400s_naming_the_field(served: Served, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(served.client(), **kwargs)
    assert caught.value.body["param"] == param, caught.value.body
    if param == "tools":
        assert "has no tool-call parser" in caught.value.body["message"]
        # the same model without tools is served as usual
        ok = httpx.post(f"{served.url}/v1/chat/completions", headers={"Authorization": f"Bearer {served.api_key}"},
                        json={"model": PLAIN, "messages": QUESTION, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text


def test_a_schema_the_grammar_engine_cannot_enforce_is_a_400_naming_that_tool_when_constrained(
        served: Served) -> None:
    tags = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        create(served.client(), tools=[*TOOLS, tags], tool_choice="required", max_tokens=8)
    error = caught.value.body
    assert error["param"] == "tools[2].function.parameters" and "uniqueItems" in error["message"], error
    # in auto mode nothing has to enforce it: the request is served
    reply = create(served.client(), tools=[*TOOLS, tags], max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_n_choices_each_get_their_own_calls_streamed_and_not(served: Served) -> None:
    client = served.client()
    whole = create(client, tool_choice="required", parallel_tool_calls=False, n=2, temperature=1, seed=21)
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], set(SCHEMAS))
    chunks = list(create(client, tool_choice="required", parallel_tool_calls=False, n=2, temperature=1, seed=21,
                         stream=True))
    for index, choice in enumerate(whole.choices):
        mine = [c.model_copy(update={"choices": [ch for ch in c.choices if ch.index == index]}) for c in chunks]
        _, calls, finish = reassemble([c for c in mine if c.choices])
        assert finish == "tool_calls"
        assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
