"""Schema-driven fuzzing of the HTTP API: schemathesis reads the live gateway's /openapi.json and generates requests
for every operation, ones that fit the schema and ones that break it, sent to a real `ember serve` on loopback.
Property: no 5xx but a 503 with Retry-After, every non-2xx an OpenAI error object with no exception name or
traceback, and the server healthy afterwards. Bounded by EMBER_FUZZ_SECONDS (default 30)."""

from __future__ import annotations

import os
import time
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

SECONDS = float(os.environ.get("EMBER_FUZZ_SECONDS", "30"))
MODEL = "tiny-llama"
# Generation is the replica's time, not the parser's: a valid request may ask for the whole 2,048-token context,
# which tiny-llama takes seconds to write (an absent limit means that too). Such limits are cut to this, so the
# budget goes on inputs; a request still unanswered after TIMEOUT_S is a hang, counted as a failure.
GENERATED_TOKENS = 8
_LIMITS = ("max_tokens", "max_completion_tokens", "min_tokens")
TIMEOUT_S = 30


def _aim(case: Any, at_model: int, at_route: int) -> None:
    """Point most cases at the served model: with a random name almost every one ends at the gateway's 404, and the
    parser in the replica would never be reached."""
    if at_route and "name" in (case.path_parameters or {}):
        case.path_parameters["name"] = MODEL
    body = case.body
    if isinstance(body, dict):
        if at_model and "model" in body:
            body["model"] = MODEL if at_model > 1 else f"{MODEL}:{body['model']}"
        for key in _LIMITS:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and GENERATED_TOKENS < value <= 4096:
                body[key] = GENERATED_TOKENS
        if body.get("max_tokens") is None and "max_completion_tokens" not in body:
            body["max_tokens"] = GENERATED_TOKENS  # absent or null: up to the context


def test_schema_driven_campaign_finds_no_5xx_and_only_openai_error_objects(gateway: Any, campaign: Any,
                                                                           assert_healthy: Any) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    cases = st.one_of(schema.as_strategy(generation_mode=GenerationMode.POSITIVE),
                      schema.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    run = campaign("http-schema (schemathesis)")
    deadline = time.monotonic() + SECONDS
    session = requests.Session()

    # No shrinking: the campaign records each violation's inputs and goes on, so it ends within its budget.
    @settings(max_examples=max(50, int(SECONDS * 60)), deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases, at_model=st.integers(0, 3), at_route=st.integers(0, 3))
    def fuzz(case: Any, at_model: int, at_route: int) -> None:
        if time.monotonic() > deadline:
            return
        _aim(case, at_model, at_route)
        what = f"{case.method} {case.formatted_path} {case.body!r}"[:400]
        try:
            response = case.call(base_url=gateway.url, session=session, headers=gateway.auth, timeout=TIMEOUT_S)
        except requests.RequestException as e:
            run.record_transport_error(e, what)
            return
        run.record(response.status_code, response.headers, response.content, what)

    fuzz()
    summary = run.report()
    assert_healthy(gateway)
    assert summary["inputs"] >= 50, summary
    assert not summary["violations"], summary["violations"]
