"""The gateway's OpenAPI 3.1 document, served at GET /openapi.json: the OpenAI routes and the per-model routes,
their request bodies taken from the pydantic models the replicas parse them with (gateway/protocol.py), and the
OpenAI error object every non-2xx answer carries.

It is served without a key, like /health: it is built once from code that is public, names no deployment, key,
replica address or setting, and costs one prebuilt response per request. /admin and /metrics are left out (they
are for operators, not for API clients)."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from ember_platform.gateway.errors import ERROR_TYPES
from ember_platform.gateway.protocol import ChatCompletionRequest, CompletionRequest

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI's error object: every key always present.",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"], "description": "The request field at fault, as OpenAI names it."},
            "code": {"type": ["string", "null"]},
        },
    }},
}

_ERROR_DESCRIPTIONS = {
    400: "The request is invalid; `param` names the field.",
    401: "No API key, or a wrong one.",
    404: "No such model (the message lists the served ones), or no such route.",
    413: "The body is larger than the gateway accepts.",
    429: "The model's queue is full, or this key has too many requests open; see Retry-After.",
    503: "No replica can take the request in time; see Retry-After.",
}


def _error(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _ERROR_DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}},
    }
    if status in (429, 503):
        response["headers"] = {"Retry-After": {"schema": {"type": "integer", "minimum": 0},
                                               "description": "Seconds to wait before retrying."}}
    return response


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(status): _error(status) for status in statuses}


_MODEL_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
               "description": "The deployment's name."}
_OBJECT = {"type": "object"}


def _generation(model: type[BaseModel], summary: str, per_model: bool) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}},
        "responses": {
            "200": {"description": "The completion; with `stream: true`, server-sent events ending in [DONE].",
                    "content": {"application/json": {"schema": _OBJECT},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 413, 429, 503),
        },
    }
    if per_model:
        operation["parameters"] = [_MODEL_NAME]
        operation["summary"] += " (one model: the body's `model` may be left out)"
    return {"post": operation}


def _get(summary: str, schema: dict[str, Any], *errors: int, per_model: bool = False,
         open_route: bool = False, path: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": summary, "content": {"application/json": {"schema": schema}}},
                      **_errors(*errors)},
    }
    if per_model or path:
        operation["parameters"] = ([_MODEL_NAME] if per_model else []) + (path or [])
    if open_route:
        operation["security"] = []
    return {"get": operation}


_MODEL_ID = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
             "description": "A model id as /v1/models lists it."}
_MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
          "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                         "owned_by": {"type": "string"}}}
_MODEL_LIST = {"type": "object", "required": ["object", "data"],
               "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _OBJECT}}}


@cache
def openapi_document() -> dict[str, Any]:
    """The document (built once: it depends on code only)."""
    _, definitions = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
                                        ref_template=_REF)
    schemas = {**definitions["$defs"], "Error": ERROR_SCHEMA}
    chat, completion = "Create a chat completion", "Create a completion"
    return {
        "openapi": "3.1.0",
        "info": {"title": "Ember gateway", "version": "1",
                 "description": "OpenAI-compatible routes and per-model routes. Non-2xx answers are OpenAI error "
                                f"objects; `type` per status: {json.dumps(ERROR_TYPES)}."},
        "components": {"schemas": schemas,
                       "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                                      "description": "A key from `ember keys create`."}}},
        "security": [{"apiKey": []}],
        "paths": {
            "/v1/chat/completions": _generation(ChatCompletionRequest, chat, per_model=False),
            "/v1/completions": _generation(CompletionRequest, completion, per_model=False),
            "/v1/models": _get("The deployed models and their LoRA adapters", _MODEL_LIST, 401),
            "/v1/models/{model}": _get("One model (a deployment, or NAME:ADAPTER for a LoRA adapter)", _MODEL, 401,
                                       404, path=[_MODEL_ID]),
            "/models/{name}/v1/chat/completions": _generation(ChatCompletionRequest, chat, per_model=True),
            "/models/{name}/v1/completions": _generation(CompletionRequest, completion, per_model=True),
            "/models/{name}/v1/models": _get("One deployed model and its adapters", _MODEL_LIST, 401, 404,
                                             per_model=True),
            "/models/{name}/v1/models/{model}": _get("One model of this deployment (itself or NAME:ADAPTER)", _MODEL,
                                                     401, 404, per_model=True, path=[_MODEL_ID]),
            "/models/{name}/info": _get("A model's version, digest, chosen techniques and cold-start timings",
                                        _OBJECT, 401, 404, per_model=True),
            "/health": _get("Liveness", {"type": "object", "required": ["status"],
                                         "properties": {"status": {"const": "ok"}}}, open_route=True),
            OPENAPI_PATH: _get("This document", _OBJECT, open_route=True),
        },
    }


@cache
def openapi_bytes() -> bytes:
    """The document as the JSON bytes GET /openapi.json answers with."""
    return json.dumps(openapi_document(), separators=(",", ":")).encode()


async def openapi_endpoint(request: Request) -> Response:
    """GET /openapi.json."""
    return Response(openapi_bytes(), media_type="application/json")
