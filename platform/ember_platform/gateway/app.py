"""The gateway's Starlette app: OpenAI routes and per-model routes proxied to replicas, model info, metrics, and
the admin API of the control plane. Errors are OpenAI error objects."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.errors import EmberError, RegistryError
from ember_platform.control.deployments import Deployment
from ember_platform.control.plane import ControlError, ControlPlane, DeploymentNotFound, NoReplicaAvailable, QueueFull
from ember_platform.gateway import request_body
from ember_platform.gateway.admission import Admission
from ember_platform.gateway.auth import ADMIN_KEY_ENV, Authenticator
from ember_platform.gateway.errors import (
    ProtocolError,
    error_body,
    error_type_for,
    invalid_api_key,
    invalid_request,
    model_not_found,
    overloaded,
    service_unavailable,
)
from ember_platform.gateway.metrics import GatewayMetrics
from ember_platform.gateway.openapi import OPENAPI_PATH, openapi_endpoint
from ember_platform.gateway.protocol import MAX_PROMPTS, MAX_PROMPTS_ENV, parse_model_name
from ember_platform.gateway.proxy import CLIENT_CLOSED, Proxy, ReplicaChooser
from ember_platform.gateway.request_body import check_text
from ember_platform.replica.auth import auth_headers

logger = logging.getLogger("ember.gateway")

INFO_TIMEOUT_S = 5.0
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", OPENAPI_PATH})
ADMIN_STATE = "admin"  # request.state.admin: whether the request came with the admin key (or the gateway has none)
API_KEY_STATE = "api_key"  # request.state.api_key: the name of the request's API key (absent without keys)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_response(error: ProtocolError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


class AuthMiddleware:
    """Bearer API keys on every route but /health, /ready and /metrics; the admin key on /admin/..."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator | None, metrics: GatewayMetrics) -> None:
        self.app = app
        self.authenticator = authenticator
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.authenticator is None or scope["path"] in OPEN_PATHS:
            if scope["type"] == "http" and self.authenticator is None:  # no keys: anyone may do what the admin may
                scope.setdefault("state", {})[ADMIN_STATE] = True
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope)
        record = self.authenticator.authenticate(token) if token else None
        admin_route = scope["path"].startswith("/admin")
        if record is None:
            error = invalid_api_key(missing=not token)
        elif admin_route and not record.admin:
            error = ProtocolError(401, f"The /admin API needs the admin key (${ADMIN_KEY_ENV}, or the key "
                                       "`ember serve` printed when it first started).", None, "admin_key_required")
        else:
            scope.setdefault("state", {})[ADMIN_STATE] = record.admin  # request.state.admin, for what only it sees
            scope["state"][API_KEY_STATE] = record.name  # request.state.api_key: the admission gate's per-key limit
            await self.app(scope, receive, send)
            return
        self.metrics.count("", "admin" if admin_route else "api", error.status)
        response = error_response(error)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return (token.strip() or None) if scheme.lower() == "bearer" else None
    return None


class DeployBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reference: str = Field(min_length=1)
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=1)
    overrides: dict[str, str | int | float | bool] | None = None


class PromoteBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(min_length=1)


class Gateway:
    """The route handlers, over one control plane and one proxy."""

    def __init__(self, plane: ControlPlane, proxy: Proxy, metrics: GatewayMetrics,
                 ready: Callable[[], bool] | None = None) -> None:
        self.plane = plane
        self.proxy = proxy
        self.metrics = metrics
        self._ready = ready or (lambda: True)
        self._info_client = httpx.AsyncClient(timeout=INFO_TIMEOUT_S)

    async def aclose(self) -> None:
        await self._info_client.aclose()

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route(OPENAPI_PATH, openapi_endpoint, methods=["GET"]),  # open, like /health: see gateway/openapi.py
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics_page, methods=["GET"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model}", self.retrieve_model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/models/{name}/v1/models", self.list_models, methods=["GET"]),
            Route("/models/{name}/v1/models/{model}", self.retrieve_model, methods=["GET"]),
            Route("/models/{name}/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/models/{name}/v1/completions", self.completions, methods=["POST"]),
            Route("/models/{name}/info", self.info, methods=["GET"]),
            Route("/admin/deployments", self.admin_list, methods=["GET"]),
            Route("/admin/deployments", self.admin_deploy, methods=["POST"]),
            Route("/admin/deployments/{name}", self.admin_describe, methods=["GET"]),
            Route("/admin/deployments/{name}", self.admin_delete, methods=["DELETE"]),
            Route("/admin/deployments/{name}/promote", self.admin_promote, methods=["POST"]),
            Route("/admin/deployments/{name}/rollback", self.admin_rollback, methods=["POST"]),
        ]

    # --- probes and metrics -------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """200 once the deployments `ember serve` started with are up and each deployment that keeps replicas
        has a ready one."""
        waiting = [d.name for d in self.plane.list() if d.desired > 0 and not d.ready_replicas()]
        if self._ready() and not waiting:
            return JSONResponse({"status": "ready", "models": self.plane.names()})
        return JSONResponse({"status": "starting", "waiting_for": waiting}, status_code=503,
                            headers={"Retry-After": "1"})

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    # --- OpenAI routes ------------------------------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        name = request.path_params.get("name")
        deployments = [self._deployment(name, name)] if name else self.plane.list()
        return JSONResponse({"object": "list", "data": _model_objects(deployments)})

    async def retrieve_model(self, request: Request) -> Response:
        """GET /v1/models/{model}: one model object of the list (a deployment, or NAME:ADAPTER), else a 404."""
        model, name = request.path_params["model"], request.path_params.get("name")
        deployments = [self._deployment(name, name)] if name else self.plane.list()
        objects = _model_objects(deployments)
        for obj in objects:
            if obj["id"] == model:
                return JSONResponse(obj)
        raise model_not_found(model, (obj["id"] for obj in objects))

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", "chat.completions")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", "completions")

    async def _generate(self, request: Request, path: str, endpoint: str) -> Response:
        received_at = time.monotonic()
        request_id = request_body.request_id(request.headers.get("x-request-id"))
        body = await _read_body(request)
        payload = request_body.loads(body)  # a nesting limit first: never a RecursionError
        check_text(payload, body)  # a lone surrogate would fail every later encode (errors, logs, the tokenizer)
        if not isinstance(payload, dict):
            raise invalid_request(None, "The request body must be a JSON object.", "invalid_type")
        _check_fan_out(payload)
        route_name = request.path_params.get("name")
        model = payload.get("model")
        if route_name is not None and (not isinstance(model, str) or parse_model_name(model)[0] != route_name):
            # On /models/NAME/... the path names the model; the body's model may be left out.
            payload["model"] = route_name
            body = json.dumps(payload).encode()
            model = route_name
        if model is None:
            raise invalid_request("model", "Missing required parameter: 'model'.", "missing_required_parameter")
        if not isinstance(model, str):
            raise invalid_request("model", f"Invalid type for 'model': expected a string, got {json.dumps(model)}.",
                                  "invalid_type")
        name, _adapter = parse_model_name(model)
        try:
            response = await self.proxy.forward(name, path, body, request_id=request_id, endpoint=endpoint,
                                                received_at=received_at, receive=request.receive,
                                                key=getattr(request.state, API_KEY_STATE, None), payload=payload)
        except ControlError as e:
            error = control_error(e, model=model)
            self.metrics.count(name if not isinstance(e, DeploymentNotFound) else "", endpoint, error.status)
            raise error from None
        except ProtocolError as e:
            self.metrics.count(name, endpoint, e.status)
            raise
        return response or Response(status_code=CLIENT_CLOSED)  # nobody is listening any more

    # --- model info ---------------------------------------------------------------------------------------

    async def info(self, request: Request) -> Response:
        name = request.path_params["name"]
        dep = self._deployment(name, name)
        active = dep.active
        replica_info, replica = None, None
        for candidate in dep.ready_replicas():
            try:
                response = await self._info_client.get(f"{candidate.url}/info", headers=auth_headers(candidate.secret))
                if response.status_code == 200:
                    replica_info, replica = response.json(), candidate
                    break
            except (httpx.HTTPError, ValueError):
                continue
        state, state_source = await self.plane.deployment_state(dep)
        timings: dict[str, Any] = {"pull": round(active.pull.resolve_s + active.pull.pull_s, 6)}
        if replica is not None and replica.start_s is not None:
            timings["replica_start"] = round(replica.start_s, 6)
        if replica_info:
            timings.update(replica_info.get("timings") or {})
        public = {
            "name": dep.name,
            "version": dep.active_version,
            "description": active.manifest.model.description,
            "license": active.manifest.model.license,
            "digest": active.digest,
            "versions": sorted(dep.versions),
            "state": str(state),
            "state_source": state_source,
            "selections": replica_info.get("selections") if replica_info else None,
            "kernel_ops": replica_info.get("kernel_ops") if replica_info else None,
            "timings": timings,
            "pull": active.pull.to_json(),
            "max_model_len": (replica_info or {}).get("max_model_len", active.manifest.runtime.max_model_len),
            "scaling": dep.to_json()["scaling"],
            "note": None if replica_info else "no replica is running; selections and load timings appear once "
                                              "one has started",
        }
        if not getattr(request.state, ADMIN_STATE, False):
            # Replicas' URLs, PIDs and their own reports are for the admin: with a URL, a caller could try the
            # replica directly, around the gateway's keys and limits.
            return JSONResponse({**public, "replicas": [{"version": r.version, "state": str(r.state)}
                                                        for r in dep.replicas]})
        return JSONResponse({**public, "replicas": [r.to_json() for r in dep.replicas], "replica": replica_info})

    # --- admin --------------------------------------------------------------------------------------------

    async def admin_list(self, request: Request) -> Response:
        return JSONResponse({"deployments": [d.to_json() for d in self.plane.list()]})

    async def admin_deploy(self, request: Request) -> Response:
        body = _parse(DeployBody, await _read_body(request))
        overrides = {k: json.dumps(v) if isinstance(v, bool) else str(v) for k, v in (body.overrides or {}).items()}
        dep = await self._operation(self.plane.deploy(body.reference, min_replicas=body.min_replicas,
                                                      max_replicas=body.max_replicas,
                                                      overrides=overrides if body.overrides is not None else None))
        return JSONResponse(dep.to_json(detail=True), status_code=201)

    async def admin_describe(self, request: Request) -> Response:
        return JSONResponse(self._deployment(request.path_params["name"]).to_json(detail=True))

    async def admin_delete(self, request: Request) -> Response:
        dep = await self._operation(self.plane.delete(request.path_params["name"]))
        return JSONResponse({"deleted": dep.name, "versions": sorted(dep.versions)})

    async def admin_promote(self, request: Request) -> Response:
        body = _parse(PromoteBody, await _read_body(request))
        dep = await self._operation(self.plane.promote(request.path_params["name"], body.version))
        return JSONResponse(dep.to_json(detail=True))

    async def admin_rollback(self, request: Request) -> Response:
        dep = await self._operation(self.plane.rollback(request.path_params["name"]))
        return JSONResponse(dep.to_json(detail=True))

    async def _operation(self, operation: Awaitable[Deployment]) -> Deployment:
        try:
            return await operation
        except ControlError as e:
            raise control_error(e) from None
        except RegistryError as e:
            raise ProtocolError(404, str(e), "reference", "package_not_found") from None
        except EmberError as e:
            raise ProtocolError(400, str(e), None, "invalid_package") from None

    def _deployment(self, name: str, model: str | None = None) -> Deployment:
        try:
            return self.plane.get(name)
        except DeploymentNotFound as e:
            raise control_error(e, model=model) from None


def control_error(e: ControlError, *, model: str | None = None) -> ProtocolError:
    """The OpenAI error object for a control-plane refusal."""
    if isinstance(e, DeploymentNotFound):
        if model is not None:
            return model_not_found(model, e.available)
        return ProtocolError(404, e.message, "name", "deployment_not_found")
    if isinstance(e, QueueFull):
        return overloaded(e.message, e.retry_after)
    if isinstance(e, NoReplicaAvailable):
        return service_unavailable(e.message, e.retry_after)
    return ProtocolError(e.status, e.message, None, type(e).__name__.lower(), retry_after=e.retry_after)


async def _read_body(request: Request) -> bytes:
    # A 413 as an OpenAI error object (Starlette's own max_body_size answers in plain text), before reading it all.
    return await request_body.read_body(request, request.app.state.max_body_bytes)


def _model_objects(deployments: Iterable[Deployment]) -> list[dict[str, Any]]:
    """OpenAI's model objects of /v1/models: each deployment, then its LoRA adapters as NAME:ADAPTER."""
    data = []
    for dep in deployments:
        data.append({"id": dep.name, "object": "model", "created": int(dep.created_at), "owned_by": "ember",
                     "root": dep.name, "parent": None, "version": dep.active_version,
                     "max_model_len": dep.active.manifest.runtime.max_model_len})
        for adapter in dep.active.manifest.lora:
            data.append({"id": f"{dep.name}:{adapter.name}", "object": "model", "created": int(dep.created_at),
                         "owned_by": "ember", "root": dep.name, "parent": dep.name, "version": dep.active_version})
    return data


def _check_fan_out(payload: dict[str, Any]) -> None:
    """Refuse a prompt list longer than MAX_PROMPTS before it reaches a replica (each prompt is an engine request)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) and len(prompt) > MAX_PROMPTS:
        raise invalid_request("prompt", f"Invalid 'prompt': at most {MAX_PROMPTS} prompts per request, got "
                                        f"{len(prompt)} ({MAX_PROMPTS_ENV} sets the limit). Send several requests.")


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise invalid_request(param, f"Invalid '{param}': {first['msg']}" if param else first["msg"]) from None


async def _protocol_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProtocolError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"No route {request.method} {request.url.path}.",
               405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code, exc.detail)
    return JSONResponse(error_body(message, error_type_for(exc.status_code)), status_code=exc.status_code,
                        headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    # The exception goes to the log only: its class and text can reveal internals (paths, hosts, code).
    request_id = request_body.request_id(request.headers.get("x-request-id"))
    logger.error("%s %s failed (request %s)", request.method, request.url.path, request_id, exc_info=exc)
    return JSONResponse(error_body(f"The gateway hit an internal error (request id {request_id}). Please retry; if "
                                   "it persists, report the request id.", "server_error", None, "internal_error"),
                        status_code=500, headers={"X-Request-Id": request_id})


def create_app(plane: ControlPlane, *, authenticator: Authenticator | None, chooser: ReplicaChooser | None = None,
               ready: Callable[[], bool] | None = None,
               on_startup: Callable[[], Awaitable[None]] | None = None,
               max_body_bytes: int | None = None) -> Starlette:
    """The gateway over `plane`. `authenticator=None` serves without keys (local development only).
    `max_body_bytes`: the largest request body accepted (default: $EMBER_MAX_BODY_BYTES, else 32 MiB).

    The app's lifespan starts the control plane (then `on_startup`, if given) and drains it on shutdown.
    """
    metrics = GatewayMetrics(plane)
    proxy = Proxy(plane, metrics, chooser=chooser)
    # Other gateways' replicas (shared routing tables) take this gateway's requests too: they add capacity.
    proxy.admission = Admission(plane, remote=lambda dep: len(proxy.chooser.remote_candidates(dep)))
    gateway = Gateway(plane, proxy, metrics, ready)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await plane.start()
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            await plane.shutdown()
            await proxy.aclose()
            await gateway.aclose()

    app = Starlette(routes=gateway.routes(), lifespan=lifespan,
                    exception_handlers={ProtocolError: _protocol_error, HTTPException: _http_error,
                                        Exception: _server_error})
    app.add_middleware(AuthMiddleware, authenticator=authenticator, metrics=metrics)  # type: ignore[arg-type]
    app.state.gateway = gateway
    app.state.max_body_bytes = request_body.max_body_bytes() if max_body_bytes is None else max_body_bytes
    return app
