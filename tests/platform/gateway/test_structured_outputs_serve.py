"""Structured outputs end to end: the official `openai` client through `ember serve` (gateway, control plane and a
replica process on loopback) serving examples/tiny-llama, a 5M-parameter model that writes Python, not JSON: every
valid answer here is the grammar's doing."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-llama"
ADMIN_KEY = "ember-sk-admin-for-structured-tests"
MODEL = "tiny-llama"
# Bounded strings, enums and integers: a random walk through this grammar ends well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "weather": {"enum": ["sunny", "rainy", "windy"]},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rating", "weather", "open"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}


@dataclass
class Served:
    url: str
    api_key: str
    home: Path
    pids: set[int] = field(default_factory=set)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, stop_serve: Callable[..., None],
           serve_ready_url: Callable[..., str], launch_serve: Callable[..., Any]) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("structured")
    launched = launch_serve(tmp, EXAMPLE, ADMIN_KEY)
    process, log = launched.process, launched.log
    server = Served("", launched.api_key, tmp / "home")
    try:
        server.url = serve_ready_url(process, log, 120.0)
        deployment = httpx.get(f"{server.url}/admin/deployments/{MODEL}", timeout=60,
                               headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
        server.pids.update(r["pid"] for r in deployment["replicas"] if r["pid"])
        yield server
    finally:
        stop_serve(process, server.pids, server.home)


def replica_counter(served: Served, name: str) -> float:
    """A counter summed over the deployment's replicas (their /metrics answer without a key)."""
    deployment = httpx.get(f"{served.url}/admin/deployments/{MODEL}", timeout=60,
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    total = 0.0
    for replica in deployment["replicas"]:
        if replica["state"] == "ready":
            text = httpx.get(f"{replica['url']}/metrics", timeout=10).text
            match = re.search(rf"^{re.escape(name)}_total ([0-9.e+-]+)$", text, re.M)
            assert match, f"{name} not in {replica['url']}/metrics"
            total += float(match.group(1))
    return total


def ask(client: openai.OpenAI, seed: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Review a city as JSON."}], temperature=1.0, seed=seed,
        max_tokens=80, **kwargs)


def test_fifty_seeded_samples_at_temperature_1_all_validate_against_the_schema(served: Served) -> None:
    client = served.client()
    compiled, hits = (replica_counter(served, f"ember_grammar{s}") for s in ("s_compiled", "_cache_hits"))
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda seed: ask(client, seed, response_format=RESPONSE_FORMAT), range(50)))
    texts = [r.choices[0].message.content for r in replies]
    for reply, text in zip(replies, texts, strict=True):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reply.choices[0].finish_reason == "stop"
    assert len(set(texts)) > 10  # sampled, not one answer repeated
    # The schema was compiled once; the other 49 requests found it in the replica's cache.
    assert replica_counter(served, "ember_grammars_compiled") - compiled == 1
    assert replica_counter(served, "ember_grammar_cache_hits") - hits >= 49
    # The same requests without the schema: the model's own output is not JSON at all.
    with ThreadPoolExecutor(16) as pool:
        free = list(pool.map(lambda seed: ask(client, seed).choices[0].message.content, range(10)))
    assert not any(_is_json(text) for text in free)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class Review(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    rating: int = pydantic.Field(ge=1, le=5)
    weather: Literal["sunny", "rainy", "windy"]


def test_parse_returns_the_pydantic_object(served: Served) -> None:
    completion = served.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Review a city."}], response_format=Review,
        temperature=1.0, seed=3, max_tokens=80)
    review = completion.choices[0].message.parsed
    assert isinstance(review, Review) and 1 <= review.rating <= 5 and len(review.city) <= 12


def test_a_streamed_answer_validates_too(served: Served) -> None:
    stream = ask(served.client(), 7, response_format=RESPONSE_FORMAT, stream=True)
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len([c for c in chunks if c.choices[0].delta.content]) > 3  # streamed token by token, not at the end
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_take_vllm_s_regex_and_choice(served: Served) -> None:
    client = served.client()
    regex = client.completions.create(model=MODEL, prompt="def f():", max_tokens=20, temperature=1.0, seed=1,
                                      extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[2] == "-"
    choice = client.completions.create(model=MODEL, prompt="x =", max_tokens=20, temperature=1.0, seed=2,
                                       extra_body={"guided_choice": ["alpha", "beta"]})
    assert choice.choices[0].text in ("alpha", "beta")
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=120,
                                         temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("kwargs,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}},
     "response_format.json_schema.schema", "uniqueItems"),
    ({"extra_body": {"structured_outputs": {"regex": "(?<=x)y"}}}, "structured_outputs.regex", "look-around"),
    ({"extra_body": {"guided_grammar": "start: nowhere"}}, "guided_grammar", "unknown name"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex", "once"),
])
def test_a_constraint_that_cannot_be_enforced_is_a_400_naming_the_field(
        served: Served, kwargs: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, **kwargs)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and needle in error["message"], error


def test_n_choices_each_follow_the_schema_on_both_endpoints(served: Served) -> None:
    client = served.client()
    chat = ask(client, 11, response_format=RESPONSE_FORMAT, n=3)
    completion = client.completions.create(model=MODEL, prompt="review:", max_tokens=80, temperature=1.0, seed=12,
                                           n=3, extra_body={"response_format": RESPONSE_FORMAT})
    texts = [c.message.content for c in chat.choices] + [c.text for c in completion.choices]
    assert len(texts) == 6
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
