"""GET /openapi.json: served without a key by the real gateway, a valid OpenAPI document schemathesis can load, built
from the request models the replicas parse bodies with."""

from __future__ import annotations

from typing import Any

import httpx
import schemathesis

from ember_platform.gateway.openapi import openapi_document
from ember_platform.gateway.protocol import ChatCompletionRequest, CompletionRequest

ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}",
          "/models/{name}/v1/chat/completions", "/models/{name}/v1/completions", "/models/{name}/v1/models",
          "/models/{name}/v1/models/{model}", "/models/{name}/info", "/health", "/openapi.json"}


def test_openapi_json_is_served_without_a_key_and_nothing_else_is(gateway: Any) -> None:
    response = httpx.get(f"{gateway.url}/openapi.json", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    document = response.json()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == ROUTES
    assert "/admin/deployments" not in document["paths"]
    refused = httpx.get(f"{gateway.url}/v1/models", timeout=30)  # opening the schema opened nothing else
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_every_operation_of_the_document_loads_in_schemathesis(gateway: Any) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # raises on an invalid operation
    assert {op.path for op in operations} >= ROUTES - {"/openapi.json"}  # it may leave out the schema's own
    assert {op.method.upper() for op in operations if op.path.endswith("completions")} == {"POST"}


def test_request_bodies_are_the_protocol_models_and_errors_the_openai_object() -> None:
    document = openapi_document()
    schemas = document["components"]["schemas"]
    assert set(schemas["ChatCompletionRequest"]["properties"]) == set(ChatCompletionRequest.model_fields)
    assert set(schemas["CompletionRequest"]["properties"]) == set(CompletionRequest.model_fields)
    assert schemas["CompletionRequest"]["required"] == ["model", "prompt"]
    assert schemas["Error"]["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert {"400", "401", "404", "413", "429", "503"} <= set(chat["responses"])
    assert "Retry-After" in chat["responses"]["503"]["headers"]
    assert document["paths"]["/health"]["get"]["security"] == []
