"""Request parsing: every bad field is a 400 naming it; good bodies map to the right SamplingParams; error objects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ember_platform.engine.sampling_params import SamplingParams
from ember_platform.gateway.errors import (
    ProtocolError,
    context_length_exceeded,
    error_body,
    invalid_api_key,
    model_not_found,
    overloaded,
    service_unavailable,
)
from ember_platform.gateway.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    parse_model_name,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
MESSAGES = [{"role": "user", "content": "Hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Once upon a time", **fields}


def chat_error(body: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_chat_request(body)
    return info.value


def completion_error(body: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_completion_request(body)
    return info.value


@pytest.mark.parametrize(("body", "param", "code"), [
    (chat(temperature=-1), "temperature", "invalid_value"),
    (chat(temperature="0.7"), "temperature", "invalid_type"),
    (chat(top_p=0), "top_p", "invalid_value"),
    (chat(top_p=2), "top_p", "invalid_value"),
    (chat(n=129), "n", "invalid_value"),
    (chat(n=0), "n", "invalid_value"),
    (chat(max_tokens=0), "max_tokens", "invalid_value"),
    (chat(max_completion_tokens=0), "max_completion_tokens", "invalid_value"),
    (chat(max_tokens=10, max_completion_tokens=-3), "max_completion_tokens", "invalid_value"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
    (chat(stop=["a", ""]), "stop", "invalid_value"),
    (chat(stop=["a", 7]), "stop[1]", "invalid_type"),
    (chat(stop=7), "stop", "invalid_type"),
    ({"model": "tiny"}, "messages", "missing_required_parameter"),
    (chat(messages=[]), "messages", "invalid_value"),
    (chat(messages=[{"role": "bot", "content": "hi"}]), "messages[0].role", "invalid_value"),
    (chat(messages=[*MESSAGES, {"role": "user"}]), "messages[1].content", "missing_required_parameter"),
    (chat(messages=[{"role": "user", "content": 3}]), "messages[0].content", "invalid_type"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]),
     "messages[0].content[1].type", "invalid_value"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    (chat(top_logprobs=3), "top_logprobs", "invalid_value"),
    (chat(logit_bias={"token": -100}), "logit_bias", "invalid_value"),
    (chat(logit_bias={"5": -100.5}), "logit_bias", "invalid_value"),
    (chat(logit_bias={"5": "1"}), "logit_bias.5", "invalid_type"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema", "missing_required_parameter"),
    (chat(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
    (chat(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex", "invalid_value"),
    (chat(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name",
     "missing_required_parameter"),
    (chat(tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (chat(presence_penalty=3), "presence_penalty", "invalid_value"),
    (chat(frequency_penalty=-2.5), "frequency_penalty", "invalid_value"),
    (chat(seed=1.5), "seed", "invalid_type"),
    (chat(top_k=-5), "top_k", "invalid_value"),
    (chat(min_p=1.5), "min_p", "invalid_value"),
    (chat(repetition_penalty=0), "repetition_penalty", "invalid_value"),
    (chat(max_tokens=4, min_tokens=5), "min_tokens", "invalid_value"),
    (chat(stop_token_ids=[-1]), "stop_token_ids", "invalid_value"),
    (chat(cache_salt=""), "cache_salt", "invalid_value"),
    (chat(model=None), "model", "invalid_type"),
    (chat(model="tiny:"), "model", "invalid_value"),
], ids=lambda v: None if isinstance(v, dict) else str(v))
def test_an_invalid_chat_field_is_a_400_naming_it(body: dict[str, Any], param: str, code: str) -> None:
    error = chat_error(body)
    assert (error.status, error.param, error.code, error.type) == (400, param, code, "invalid_request_error")
    assert f"'{param}'" in error.message or error.message.startswith(param.split("[")[0])


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"model": "tiny"}, "prompt", "missing_required_parameter"),
    (completion(prompt=[]), "prompt", "invalid_value"),
    (completion(prompt=[5, -1]), "prompt[1]", "invalid_value"),
    (completion(prompt=[[5], []]), "prompt[1]", "invalid_value"),
    (completion(prompt=["a", 3]), "prompt[1]", "invalid_type"),
    (completion(prompt={"text": "a"}), "prompt", "invalid_type"),
    (completion(logprobs=6), "logprobs", "invalid_value"),
    (completion(logprobs=True), "logprobs", "invalid_type"),
    (completion(suffix="end"), "suffix", "unsupported_value"),
    (completion(best_of=3, n=4), "best_of", "invalid_value"),
    (completion(best_of=3, stream=True), "best_of", "invalid_value"),
    (completion(best_of=0), "best_of", "invalid_value"),
    (completion(n=129), "n", "invalid_value"),
    (completion(prompt=["a"] * 64, n=3), "n", "invalid_value"),
    (completion(prompt=["a"] * 64, n=1, best_of=3), "best_of", "invalid_value"),
    (completion(max_tokens=0), "max_tokens", "invalid_value"),
    (completion(top_p=0), "top_p", "invalid_value"),
    (completion(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", "invalid_value"),
])
def test_an_invalid_completion_field_is_a_400_naming_it(body: dict[str, Any], param: str, code: str) -> None:
    error = completion_error(body)
    assert (error.status, error.param, error.code) == (400, param, code)


@pytest.mark.parametrize(("body", "code"), [
    (b"{not json", "invalid_json"),
    (b"", "invalid_json"),
    (b"\xff\xfe", "invalid_json"),
    (b"[1, 2]", "invalid_type"),
    (b'"text"', "invalid_type"),
])
def test_a_body_that_is_not_a_json_object_is_a_400_without_param(body: bytes, code: str) -> None:
    for error in (chat_error(body), completion_error(body)):
        assert (error.status, error.param, error.code) == (400, None, code)


def test_messages_say_what_was_wrong_and_what_was_sent() -> None:
    assert chat_error(chat(messages=[{"role": "bot", "content": "x"}])).message == (
        "Invalid 'messages[0].role': Input should be 'system', 'developer', 'user', 'assistant' or 'tool' "
        "(got 'bot').")
    assert chat_error({"model": "tiny"}).message == "Missing required parameter: 'messages'."
    assert chat_error(chat(top_p=0)).message == "Invalid 'top_p': top_p must be in (0, 1], got 0.0."
    # The engine calls it max_tokens; the message uses the name the client sent.
    assert chat_error(chat(max_completion_tokens=0)).message.startswith(
        "Invalid 'max_completion_tokens': max_completion_tokens must be >= 1")
    assert chat_error(chat(n=300)).message == "Invalid 'n': it must be in [1, 128], got 300."


def test_bytes_str_and_decoded_bodies_parse_alike() -> None:
    body = chat(temperature=0.5, stop="\n")
    parsed = [parse_chat_request(json.dumps(body).encode()), parse_chat_request(json.dumps(body)),
              parse_chat_request(body)]
    assert all(p == parsed[0] for p in parsed)
    assert isinstance(parsed[0], ChatCompletionRequest)


def test_a_full_chat_request_maps_every_setting_to_sampling_params() -> None:
    request = parse_chat_request(chat(
        temperature=0.2, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=-0.5, stop=["\n\n", "END"],
        max_tokens=50, logprobs=True, top_logprobs=3, user="u-1", top_k=40, min_p=0.05, repetition_penalty=1.1,
        min_tokens=2, ignore_eos=True, stop_token_ids=[2], cache_salt="tenant-a", logit_bias={"9": 2, "3": -1.5},
        n=3))
    assert request.to_sampling_params(1000) == SamplingParams(
        temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-0.5, seed=7, max_tokens=50, min_tokens=2, stop=("\n\n", "END"), stop_token_ids=(2,),
        ignore_eos=True, logprobs=3, logit_bias={3: -1.5, 9: 2.0})
    assert request.cache_salt == "tenant-a" and request.user == "u-1" and request.num_choices == 3
    assert request.ignored_fields == []  # user, n and logit_bias all take effect (user: in the replica's log)


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    request = parse_chat_request(chat(logit_bias={"99": 1}))
    assert request.sampling_params_for(10, 128, vocab_size=100).logit_bias == ((99, 1.0),)
    with pytest.raises(ProtocolError) as info:
        request.sampling_params_for(10, 128, vocab_size=99)
    assert info.value.param == "logit_bias" and "[0, 99)" in info.value.message


def test_best_of_candidates_report_logprobs_to_be_ranked() -> None:
    request = parse_completion_request(completion(best_of=3, n=2, seed=4))
    params = request.candidate_params(request.to_sampling_params(10))
    assert (request.num_choices, request.num_candidates, params.logprobs) == (2, 3, 0)
    echoed = parse_completion_request(completion(echo=True, logprobs=2)).to_sampling_params(10)
    assert (echoed.logprobs, echoed.prompt_logprobs) == (2, 2)
    assert parse_completion_request(completion(echo=True)).to_sampling_params(10).prompt_logprobs is None
    plain = parse_completion_request(completion(n=2))
    assert plain.num_candidates == 2 and plain.candidate_params(plain.to_sampling_params(10)).logprobs is None


def test_a_minimal_chat_request_keeps_the_engine_defaults_and_fills_the_context() -> None:
    params = parse_chat_request(chat()).to_sampling_params(default_max_tokens=900)
    assert params == SamplingParams(max_tokens=900)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_chat_request(chat(max_tokens=10, max_completion_tokens=20)).to_sampling_params(100).max_tokens == 20
    assert parse_chat_request(chat(max_tokens=10)).to_sampling_params(100).max_tokens == 10


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 0}, 0),
    ({"logprobs": True, "top_logprobs": 20}, 20),
    ({"logprobs": False, "top_logprobs": 0}, None),
])
def test_chat_logprobs_and_top_logprobs_map_to_the_number_of_alternatives(fields: dict[str, Any],
                                                                          expected: int | None) -> None:
    request = parse_chat_request(chat(**fields))
    assert request.to_sampling_params(10).logprobs == expected
    assert request.wants_logprobs == (expected is not None)


@pytest.mark.parametrize(("fields", "expected"), [({}, None), ({"logprobs": 0}, 0), ({"logprobs": 5}, 5)])
def test_completion_logprobs_is_the_number_of_alternatives(fields: dict[str, Any], expected: int | None) -> None:
    assert parse_completion_request(completion(**fields)).to_sampling_params(10).logprobs == expected


def test_completions_default_to_sixteen_tokens_as_openai_does_and_null_means_the_whole_context() -> None:
    assert parse_completion_request(completion()).to_sampling_params(500).max_tokens == COMPLETION_DEFAULT_MAX_TOKENS
    assert parse_completion_request(completion()).to_sampling_params(5).max_tokens == 5
    assert parse_completion_request(completion(max_tokens=None)).to_sampling_params(500).max_tokens == 500
    assert parse_completion_request(completion(max_tokens=100)).to_sampling_params(500).max_tokens == 100


def test_sampling_params_for_a_prompt_use_the_room_left_in_the_context() -> None:
    assert parse_chat_request(chat()).sampling_params_for(num_prompt_tokens=100, max_model_len=128).max_tokens == 28
    assert parse_chat_request(chat(max_tokens=28)).sampling_params_for(100, 128).max_tokens == 28
    assert parse_completion_request(completion()).sampling_params_for(120, 128).max_tokens == 8


def test_a_prompt_plus_completion_longer_than_the_context_is_a_400_that_gives_both_lengths() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_chat_request(chat(max_tokens=50)).sampling_params_for(num_prompt_tokens=100, max_model_len=128)
    error = info.value
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert error.message == (
        "This model's maximum context length is 128 tokens. However, you requested 150 tokens (100 in the "
        "messages, 50 in the completion). Please reduce the length of the messages or of the completion "
        "(max_tokens).")


def test_a_prompt_that_fills_the_context_alone_is_a_400_about_the_prompt() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_completion_request(completion()).sampling_params_for(num_prompt_tokens=128, max_model_len=128)
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"
    assert "your prompt resulted in 128 tokens" in info.value.message


def test_min_tokens_above_the_room_left_is_a_400_about_min_tokens() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_chat_request(chat(min_tokens=50)).sampling_params_for(100, 128)
    assert info.value.param == "min_tokens"


def test_unknown_fields_are_accepted_without_effect_and_listed() -> None:
    request = parse_chat_request(chat(store=False, metadata={"a": "b"}, service_tier="auto"))
    assert request.ignored_fields == ["metadata", "service_tier", "store"]
    assert request.to_sampling_params(10) == SamplingParams(max_tokens=10)


def test_chat_messages_reach_the_template_as_strings_with_their_other_fields() -> None:
    request = parse_chat_request(chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}],
         "name": "ann"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]))
    assert request.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "line 1\nline 2", "name": "ann"},
        # the arguments' JSON text as an object: templates write it with `| tojson`
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


def test_tools_reach_the_template_unless_tool_choice_is_none() -> None:
    tool = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {}, "default": None},
                                             "strict": True}}
    assert parse_chat_request(chat(tools=[tool])).template_tools() == [tool]
    named = {"type": "function", "function": {"name": "weather"}}
    assert parse_chat_request(chat(tools=[tool], tool_choice=named)).template_tools() == [tool]
    assert parse_chat_request(chat(tools=[tool], tool_choice="none")).template_tools() is None
    assert parse_chat_request(chat()).template_tools() is None


@pytest.mark.parametrize(("prompt", "expected"), [
    ("text", ["text"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_every_prompt_form_becomes_a_batch(prompt: Any, expected: list[Any]) -> None:
    request = parse_completion_request(completion(prompt=prompt))
    assert isinstance(request, CompletionRequest) and request.prompts() == expected


def test_include_usage_needs_stream_and_stream_options() -> None:
    assert parse_chat_request(chat(stream=True, stream_options={"include_usage": True})).include_usage
    assert not parse_chat_request(chat(stream=True)).include_usage
    assert not parse_chat_request(chat(stream=True, stream_options={"include_usage": False})).include_usage
    assert not parse_chat_request(chat()).include_usage


@pytest.mark.parametrize(("model", "expected"), [
    ("tiny", ("tiny", None)),
    ("tiny:sql-lora", ("tiny", "sql-lora")),
    ("tiny:a:b", ("tiny", "a:b")),
])
def test_model_names_may_carry_a_lora_adapter(model: str, expected: tuple[str, str | None]) -> None:
    assert parse_model_name(model) == expected
    assert parse_chat_request(chat(model=model)).model_and_adapter == expected


@pytest.mark.parametrize("model", ["", ":adapter", "tiny:"])
def test_a_malformed_model_name_is_a_400_about_model(model: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_model_name(model)
    assert (info.value.status, info.value.param) == (400, "model")


def test_error_body_has_exactly_openais_shape() -> None:
    assert error_body("bad", "invalid_request_error", "top_p", "invalid_value") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": "invalid_value"}}
    assert chat_error(chat(top_p=0)).body() == {"error": {
        "message": "Invalid 'top_p': top_p must be in (0, 1], got 0.0.", "type": "invalid_request_error",
        "param": "top_p", "code": "invalid_value"}}


def test_the_gateways_errors_have_their_status_type_and_headers() -> None:
    missing, wrong = invalid_api_key(missing=True), invalid_api_key()
    assert (missing.status, missing.type, missing.code) == (401, "authentication_error", "invalid_api_key")
    assert wrong.status == 401 and "Authorization" not in wrong.message

    unknown = model_not_found("gpt-9", ["tiny", "llama"])
    assert (unknown.status, unknown.type, unknown.param, unknown.code) == (
        404, "not_found_error", "model", "model_not_found")
    assert unknown.message == "The model 'gpt-9' does not exist. Available models: llama, tiny."
    assert "No models are deployed" in model_not_found("x", []).message

    busy = overloaded(retry_after=2)
    assert (busy.status, busy.type, busy.headers()) == (429, "rate_limit_error", {"Retry-After": "2"})
    cold = service_unavailable("The model 'tiny' is starting.", retry_after=7.2)
    assert (cold.status, cold.type, cold.headers()) == (503, "service_unavailable", {"Retry-After": "8"})
    assert cold.body()["error"]["type"] == "service_unavailable"
    assert ProtocolError(500, "boom").type == "server_error" and ProtocolError(500, "boom").headers() == {}

    too_long = context_length_exceeded(4096, 4000, 200, param="prompt")
    assert "4200 tokens (4000 in the prompt, 200 in the completion)" in too_long.message


def test_the_protocol_layer_does_not_import_torch() -> None:
    code = ("import sys; import ember_platform.gateway.protocol, ember_platform.gateway.responses, "
            "ember_platform.gateway.errors; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, capture_output=True)


def test_echo_with_max_tokens_0_asks_the_engine_for_one_token_and_scores_the_prompt() -> None:
    request = parse_completion_request(completion(echo=True, max_tokens=0, logprobs=1))
    params = request.to_sampling_params(100)
    assert request.scores_prompt_only and (params.max_tokens, params.prompt_logprobs) == (1, 1)
    assert completion_error(completion(max_tokens=0)).param == "max_tokens"  # nothing to return without echo
