"""SamplingParams: defaults, normalization, and errors that name the field and its allowed range."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ember_platform.engine.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_defaults_are_valid_random_sampling_with_nothing_switched_on() -> None:
    p = SamplingParams()
    assert p.temperature == 1.0 and not p.greedy
    assert p.top_p == 1.0 and p.top_k == -1 and p.min_p == 0.0
    assert p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.seed is None and p.max_tokens is None and p.min_tokens == 0
    assert p.stop == () and p.stop_token_ids == () and not p.ignore_eos and p.logprobs is None


def test_temperature_zero_is_greedy() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_stop_and_stop_token_ids_are_normalized_to_tuples() -> None:
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[2, 7]).stop_token_ids == (2, 7)


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, repetition_penalty=0.01, presence_penalty=-2,
                       frequency_penalty=2, seed=-5, max_tokens=1, min_tokens=1, logprobs=MAX_LOGPROBS)
    assert p.top_k == 0 and p.logprobs == MAX_LOGPROBS and isinstance(p.temperature, float)
    assert SamplingParams(top_k=1, logprobs=0, seed=2**70).logprobs == 0


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("temperature", -1, ">= 0"),
    ("temperature", "hot", ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("top_p", 0, "in (0, 1]"),
    ("top_p", 1.5, "in (0, 1]"),
    ("top_k", -2, ">= 1"),
    ("top_k", 2.5, ">= 1"),
    ("min_p", -0.1, "in [0, 1]"),
    ("min_p", 1.1, "in [0, 1]"),
    ("repetition_penalty", 0, "> 0"),
    ("repetition_penalty", -1.2, "> 0"),
    ("presence_penalty", 2.5, "in [-2, 2]"),
    ("frequency_penalty", -3, "in [-2, 2]"),
    ("frequency_penalty", float("inf"), "in [-2, 2]"),
    ("seed", "abc", "integer"),
    ("seed", 1.5, "integer"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", True, ">= 1"),
    ("min_tokens", -1, ">= 0"),
    ("stop", "", "non-empty"),
    ("stop", ["ok", ""], "non-empty"),
    ("stop", [1], "non-empty"),
    ("stop_token_ids", [-1], ">= 0"),
    ("stop_token_ids", ["a"], ">= 0"),
    ("stop_token_ids", "12", ">= 0"),
    ("ignore_eos", "yes", "true or false"),
    ("logprobs", 21, "in [0, 20]"),
    ("logprobs", -1, "in [0, 20]"),
])
def test_invalid_value_names_the_field_and_the_allowed_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(f"{field} must be ") and allowed in message and f"got {value!r}" in message


def test_error_message_reads_naturally() -> None:
    with pytest.raises(SamplingParamsError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_min_tokens_above_max_tokens_is_rejected_on_min_tokens() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.field == "min_tokens" and "max_tokens (4)" in str(info.value)


def test_params_are_frozen_and_replace_validates_again() -> None:
    p = SamplingParams(temperature=0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.1  # type: ignore[misc]
    assert dataclasses.replace(p, top_k=5).top_k == 5
    with pytest.raises(SamplingParamsError):
        dataclasses.replace(p, top_k=-7)


def test_module_imports_without_torch() -> None:
    # The HTTP layer validates requests with it; it must not drag torch in.
    code = "import sys, ember_platform.engine.sampling_params; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
