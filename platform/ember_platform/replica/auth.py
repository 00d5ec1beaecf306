"""The secret a replica requires from its gateway: only the gateway (and the gateways of its cluster) may call it.

A launcher hands each replica its secret through the environment (`EMBER_REPLICA_SECRET`, never argv: argv is
visible in `ps`); the replica then answers 401 to any request without `Authorization: Bearer <secret>`, except the
probes that carry no credential and reveal nothing (`OPEN_PATHS`). Gateways that share routing tables (Redis) share
one cluster secret: `EMBER_REPLICA_SECRET` set on each of them, else the serve home's `replica-secret` file.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ember_platform.gateway.errors import ProtocolError

SECRET_ENV = "EMBER_REPLICA_SECRET"
SECRET_FILE = "replica-secret"  # in the serve home: the cluster secret when $EMBER_REPLICA_SECRET is not set
# Liveness, readiness and Prometheus scrapes, as on the gateway: probers carry no credential, and these say only
# how the replica is doing. Generation, /sleep, /wake and /info need the secret.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def auth_headers(secret: str | None) -> dict[str, str]:
    """The header a gateway sends a replica with (none for a replica that runs without a secret)."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def cluster_secret(home: Path | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The secret every gateway of a cluster uses for its replicas: `$EMBER_REPLICA_SECRET`, else `home`'s
    `replica-secret` file (created, mode 0600, when missing); None without either (then each replica gets one of
    its own, which only the gateway that launched it knows)."""
    environ = os.environ if environ is None else environ
    if value := environ.get(SECRET_ENV, "").strip():
        return value
    if home is None:
        return None
    path = home / SECRET_FILE
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another gateway on this home wrote it first: use theirs
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(new_secret() + "\n")
    return path.read_text().strip() or None


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def unauthorized(missing: bool) -> ProtocolError:
    what = "no replica secret was sent" if missing else "the replica secret is wrong"
    return ProtocolError(401, f"This replica takes requests only from its gateway, and {what} (Authorization: "
                              f"Bearer <secret>). Send requests to the gateway; a gateway that shares routing "
                              f"tables with others needs the cluster's ${SECRET_ENV}.", None, "invalid_replica_secret")


class ReplicaAuthMiddleware:
    """Requires `Authorization: Bearer <secret>` on every route but `OPEN_PATHS`; None as the secret lets all in."""

    def __init__(self, app: ASGIApp, secret: str | None) -> None:
        self.app = app
        self.secret = secret.encode() if secret else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.secret is None or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        if token is not None and hmac.compare_digest(token, self.secret):  # constant time: no guessing by timing
            await self.app(scope, receive, send)
            return
        error = unauthorized(missing=token is None)
        response = JSONResponse(error.body(), error.status, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
