"""StructuredOutput: the torch-free constraint a request carries in SamplingParams.structured, shape-checked."""

from __future__ import annotations

import dataclasses

import pytest

from ember_platform.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput


@pytest.mark.parametrize("kind,spec", [
    ("json_schema", '{"type": "object"}'),
    ("json_schema", "true"),
    ("json_object", ""),
    ("regex", r"[a-z]+\d"),
    ("grammar", 'start: "yes" | "no"'),
    ("choice", '["red", "green"]'),
])
def test_valid_constraints_ride_on_sampling_params(kind: str, spec: str) -> None:
    structured = StructuredOutput(kind, spec)  # type: ignore[arg-type]
    params = SamplingParams(structured=structured)
    assert params.structured == StructuredOutput(kind, spec)  # type: ignore[arg-type]
    assert hash(structured) == hash(StructuredOutput(kind, spec))  # type: ignore[arg-type]  # the cache key
    with pytest.raises(dataclasses.FrozenInstanceError):
        structured.spec = "x"  # type: ignore[misc]


@pytest.mark.parametrize("kind,spec,needle", [
    ("xml", "", "one of json_schema"),
    ("regex", "", "non-empty regex"),
    ("grammar", "", "non-empty grammar"),
    ("json_schema", "{", "not valid JSON"),
    ("json_schema", "[1]", "a JSON Schema"),
    ("choice", "[]", "non-empty JSON list"),
    ("choice", '["a", 3]', "non-empty JSON list"),
    ("choice", '"a"', "non-empty JSON list"),
])
def test_malformed_constraint_names_the_field(kind: str, spec: str, needle: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        StructuredOutput(kind, spec)  # type: ignore[arg-type]
    assert info.value.field.startswith("structured.") and needle in str(info.value)


def test_structured_must_be_a_structured_output() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured={"kind": "regex", "spec": "a"})  # type: ignore[arg-type]
    assert info.value.field == "structured"
