"""The output-constraint fields of a request body (OpenAI's response_format, vLLM's structured_outputs and guided_*)
mapped to SamplingParams.structured, and their shape errors as 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ember_platform.engine.sampling_params import StructuredOutput
from ember_platform.gateway.errors import ProtocolError
from ember_platform.gateway.protocol import parse_chat_request, parse_completion_request

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", **fields}


@pytest.mark.parametrize("fields,expected,param", [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", ""), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "point", "schema": SCHEMA,
                                                                 "strict": True, "description": "a point"}}},
     StructuredOutput("json_schema", SCHEMA_TEXT), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "loose", "schema": SCHEMA,
                                                                 "strict": False}}},
     StructuredOutput("json_schema", SCHEMA_TEXT), "response_format.json_schema.schema"),  # still constrained
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     StructuredOutput("json_schema", "{}"), "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", SCHEMA_TEXT),
     "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput("json_schema", SCHEMA_TEXT),
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": r"\d+"}}, StructuredOutput("regex", r"\d+"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput("choice", '["a", "b"]'),
     "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredOutput("grammar", 'start: "x"'),
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", ""),
     "structured_outputs.json_object"),
    ({"guided_json": SCHEMA}, StructuredOutput("json_schema", SCHEMA_TEXT), "guided_json"),
    ({"guided_regex": "[ab]"}, StructuredOutput("regex", "[ab]"), "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]'), "guided_choice"),
    ({"guided_grammar": 'start: "y"'}, StructuredOutput("grammar", 'start: "y"'), "guided_grammar"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None)
@pytest.mark.parametrize("make,parse", [(chat, parse_chat_request), (completion, parse_completion_request)],
                         ids=["chat", "completions"])
def test_each_constraint_field_reaches_the_sampling_params(make: Any, parse: Any, fields: dict[str, Any],
                                                           expected: StructuredOutput | None,
                                                           param: str | None) -> None:
    body = parse(make(**fields))
    assert body.to_sampling_params(16).structured == expected
    constraint = body.output_constraint()
    assert (constraint.param if constraint else None) == param
    assert "guided_json" not in body.ignored_fields and "structured_outputs" not in body.ignored_fields


def test_schema_key_order_is_kept() -> None:
    # The grammar writes properties in the schema's order: "b" before "a" here.
    body = parse_chat_request(chat(guided_json={"properties": {"b": {}, "a": {}}}))
    assert body.to_sampling_params(16).structured.spec == '{"properties":{"b":{},"a":{}}}'


def error(body: dict[str, Any]) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_chat_request(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("fields,param,code", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     "missing_required_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space"}}},
     "response_format.json_schema.name", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "invalid_type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict", "invalid_type"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "invalid_value"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "invalid_value"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]", "invalid_type"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "invalid_value"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "unsupported_value"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "invalid_value"),
    ({"guided_json": "[1, 2]"}, "guided_json", "invalid_value"),
    ({"guided_regex": 5}, "guided_regex", "invalid_type"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "invalid_value"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex", "invalid_value"),
], ids=lambda v: json.dumps(v)[:70] if isinstance(v, dict) else None)
def test_a_malformed_constraint_is_a_400_naming_the_field(fields: dict[str, Any], param: str, code: str) -> None:
    e = error(chat(**fields))
    assert (e.param, e.code) == (param, code), e.message


def test_two_constraints_name_both() -> None:
    e = error(chat(response_format={"type": "json_object"}, guided_regex="a+"))
    assert "'response_format'" in e.message and "only once" in e.message
