"""The request fields that constrain a completion's output, mapped to one `StructuredOutput`.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` object (`json`,
`regex`, `choice`, `grammar`, `json_object`) and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` fields: at most one constraint per request. Only the shape is checked here; whether the grammar
engine can honor a schema, a regex or a grammar is checked when the replica compiles it against its tokenizer
(`compile_error` turns a refusal into a 400 naming the field the constraint came from).

`strict` is accepted either way: OpenAI only promises best effort without it, and Ember, like vLLM, constrains
the output to the schema in both cases. OpenAI's strict-mode subset (every property required, additionalProperties
false, a root object) is not imposed: the grammar engine supports more of JSON Schema, and refuses by name what it
does not. Size is bounded by the request body limit and by the grammar engine's own limits (a schema past them is
a 400 too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ember_platform.engine.sampling_params import SamplingParamsError, StructuredOutput
from ember_platform.gateway.errors import ProtocolError, invalid_request, unsupported

_CONFIG = ConfigDict(strict=True, extra="allow", protected_namespaces=())
# A schema is an object or a boolean, or (vLLM) its JSON text; checked in `_schema_text`, where the error can name
# the field itself rather than a branch of a union.
JsonSchema = Any
# OpenAI's rule for json_schema.name; its own client sends the pydantic model's class name.
SCHEMA_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", protected_namespaces=(), populate_by_name=True)
    name: Annotated[str, Field(pattern=SCHEMA_NAME_PATTERN)]
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None  # best effort (False) is constrained too: see the module docstring


class ResponseFormat(BaseModel):
    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` (extra_body): one of json, regex, choice, grammar, json_object."""

    model_config = _CONFIG
    json_: JsonSchema = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ConstraintFields(BaseModel):
    """The output-constraint fields of a generation request (mixed into GenerationRequest)."""

    model_config = _CONFIG
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: JsonSchema = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def output_constraint(self) -> Constraint | None:
        """The one constraint this request sets (None: free text). Raises ProtocolError naming the field."""
        found = _constraints(self)
        if len(found) > 1:
            first, second = found[0].param, found[1].param
            raise invalid_request(second, f"Invalid '{second}': a request may constrain its output only once, "
                                          f"and this one also sets '{first}'. Send one of them.")
        return found[0] if found else None


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's output constraint and the field it came from (as the client wrote it, for errors)."""

    structured: StructuredOutput
    param: str


def _schema_text(value: Any, param: str) -> str:
    if not isinstance(value, dict | bool | str):
        raise invalid_request(param, f"Invalid '{param}': a JSON Schema is an object (or a boolean), got "
                                     f"{type(value).__name__}.", "invalid_type")
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError as e:
            raise invalid_request(param, f"Invalid '{param}': the schema is not valid JSON ({e}).") from None
        if not isinstance(value, dict | bool):
            raise invalid_request(param, f"Invalid '{param}': a JSON Schema is an object (or a boolean).")
    # Key order is kept: the grammar generates properties in the schema's order.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _make(param: str, kind: str, spec: str) -> Constraint:
    try:
        return Constraint(StructuredOutput(kind, spec), param)  # type: ignore[arg-type]
    except SamplingParamsError as e:
        detail = str(e).removeprefix(f"{e.field} must be ")
        raise invalid_request(param, f"Invalid '{param}': it must be {detail}.") from None


def _constraints(fields: ConstraintFields) -> list[Constraint]:
    found: list[Constraint] = []
    rf = fields.response_format
    if rf is not None and rf.type == "json_object":
        found.append(_make("response_format", "json_object", ""))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise invalid_request("response_format.json_schema", "Missing required parameter: "
                                  "'response_format.json_schema'.", "missing_required_parameter")
        # OpenAI allows a json_schema without a schema: any JSON then.
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        found.append(_make("response_format.json_schema.schema", "json_schema",
                           _schema_text(schema, "response_format.json_schema.schema")))
    so = fields.structured_outputs
    if so is not None:
        if so.model_extra:
            key = sorted(so.model_extra)[0]
            raise unsupported(f"structured_outputs.{key}", f"structured_outputs.{key} is not supported by Ember: "
                                                           "use one of json, regex, choice, grammar, json_object.")
        if so.json_ is not None:
            found.append(_make("structured_outputs.json", "json_schema",
                               _schema_text(so.json_, "structured_outputs.json")))
        if so.regex is not None:
            found.append(_make("structured_outputs.regex", "regex", so.regex))
        if so.choice is not None:
            found.append(_make("structured_outputs.choice", "choice", json.dumps(so.choice, ensure_ascii=False)))
        if so.grammar is not None:
            found.append(_make("structured_outputs.grammar", "grammar", so.grammar))
        if so.json_object:
            found.append(_make("structured_outputs.json_object", "json_object", ""))
    if fields.guided_json is not None:
        found.append(_make("guided_json", "json_schema", _schema_text(fields.guided_json, "guided_json")))
    if fields.guided_regex is not None:
        found.append(_make("guided_regex", "regex", fields.guided_regex))
    if fields.guided_choice is not None:
        found.append(_make("guided_choice", "choice", json.dumps(fields.guided_choice, ensure_ascii=False)))
    if fields.guided_grammar is not None:
        found.append(_make("guided_grammar", "grammar", fields.guided_grammar))
    return found


def compile_error(param: str, reason: str) -> ProtocolError:
    """400 for a constraint the grammar engine refused, naming the field and llguidance's reason."""
    return invalid_request(param, f"Invalid '{param}': it cannot be enforced: {reason}.")
