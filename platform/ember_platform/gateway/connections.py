"""Read timeouts and a per-client connection cap for uvicorn, which has neither (slowloris: a client that sends a
request's headers or body a byte at a time holds a connection, and its buffers, for as long as it likes).

`guarded_protocol(limits)` is an `http` protocol class for `uvicorn.Config(http=...)`: uvicorn's own (httptools, or
h11 without it) with three additions.

- Header timeout: from the connection's start, or from the first byte of the next request on a kept-alive one,
  until that request's headers are complete; past it the connection is closed (no request exists to answer).
- Body timeout: while the app waits for more of a request body, each chunk must come within it; past it the app's
  `receive` raises `BodyReadTimeout` (an HTTPException 408 that closes the connection), which Starlette answers
  through the app's HTTPException handler, as an OpenAI error object for the gateway and the replicas.
- At most `max_per_client` open connections per client address: the next one is answered 429 and closed.
- A request uvicorn cannot parse is answered 400 with an OpenAI error object (uvicorn's is plain text).

Idle kept-alive connections are uvicorn's `timeout_keep_alive`, as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from ember.errors import EmberError
from ember_platform.gateway.errors import error_body

log = logging.getLogger("ember.connections")

HEADER_TIMEOUT_ENV = "EMBER_HEADER_TIMEOUT_S"
BODY_TIMEOUT_ENV = "EMBER_BODY_TIMEOUT_S"
PER_CLIENT_ENV = "EMBER_MAX_CONNECTIONS_PER_CLIENT"
# A replica's one legitimate client is the gateway, which opens a connection per concurrent request: its cap is a
# variable of its own, far above the gateway's per-client one.
REPLICA_PER_CLIENT_ENV = "EMBER_REPLICA_MAX_CONNECTIONS_PER_CLIENT"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_PER_CLIENT = 256
DEFAULT_REPLICA_MAX_PER_CLIENT = 4096
REFUSED_HEADER_BYTES = 64 * 1024  # read at most this much of a refused connection's request before answering


@dataclass(frozen=True)
class ConnectionLimits:
    """Seconds to send a request's headers, seconds between two chunks of its body, open connections per client
    address (None: no cap). A timeout of 0 turns that timeout off."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_per_client: int | None = DEFAULT_MAX_PER_CLIENT

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, replica: bool = False) -> ConnectionLimits:
        """The limits from $EMBER_HEADER_TIMEOUT_S, $EMBER_BODY_TIMEOUT_S and $EMBER_MAX_CONNECTIONS_PER_CLIENT
        (for a replica: $EMBER_REPLICA_MAX_CONNECTIONS_PER_CLIENT); 0 connections means no cap."""
        env = os.environ if environ is None else environ
        per_client_env, per_client = ((REPLICA_PER_CLIENT_ENV, DEFAULT_REPLICA_MAX_PER_CLIENT) if replica
                                      else (PER_CLIENT_ENV, DEFAULT_MAX_PER_CLIENT))
        cap = int(_number(env, per_client_env, per_client))
        return cls(header_timeout_s=_number(env, HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S),
                   body_timeout_s=_number(env, BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT_S),
                   max_per_client=cap or None)


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if number < 0:
        raise EmberError(f"{name}={value!r}: expected a number >= 0")
    return number


class BodyReadTimeout(HTTPException):
    """The client stopped sending the request body: 408, and the connection is closed (the rest never comes)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"The request body stopped arriving: no data for {timeout_s:g} s. Send the whole "
                              "body without pauses.", headers={"Connection": "close"})


class BodyTimeout:
    """ASGI middleware: each `receive` of a request's body must return within `timeout_s`, else BodyReadTimeout.

    Once the body is complete, `receive` only waits for a disconnect (streams wait on it): that wait has no limit."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.timeout_s:
            await self.app(scope, receive, send)
            return
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                raise BodyReadTimeout(self.timeout_s) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


def _raw_error(status: str, error: dict[str, Any], extra_headers: str = "") -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI error object, that closes the connection."""
    body = json.dumps(error).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra_headers}connection: close\r\n\r\n").encode()
    return head + body


def _too_many_connections(cap: int) -> bytes:
    return _raw_error("429 Too Many Requests", error_body(
        f"Too many open connections from this address (at most {cap}). Reuse connections, or close some and "
        "retry.", "rate_limit_error", None, "too_many_connections"), "retry-after: 1\r\n")


# uvicorn's own answer to bytes that are not HTTP (a malformed request line or header) is plain text.
_MALFORMED = _raw_error("400 Bad Request", error_body(
    "Invalid HTTP request: the request line or a header is malformed.", "invalid_request_error", None,
    "invalid_http_request"))


def guarded_protocol(limits: ConnectionLimits, base: type[asyncio.Protocol] = AutoHTTPProtocol
                     ) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol `base` with the header timeout, body timeout and per-client cap of `limits`.

    Each call makes a class of its own, holding the connection counts of the one server it is given to."""
    open_by_client: dict[str, int] = {}
    apps: dict[int, tuple[Any, BodyTimeout]] = {}  # id(the app uvicorn loaded) -> (it, it wrapped), one per server
    refusal = _too_many_connections(limits.max_per_client or 0)

    class GuardedProtocol(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            app = self.app
            if id(app) not in apps:
                apps[id(app)] = (app, BodyTimeout(app, limits.body_timeout_s))
            self.app = apps[id(app)][1]
            self._header_timer: asyncio.TimerHandle | None = None
            self._counted_as: str | None = None
            self._refused: bytearray | None = None  # what a connection over the cap sent so far

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = self.client[0] if self.client else None
            if limits.max_per_client and peer is not None:
                if open_by_client.get(peer, 0) >= limits.max_per_client:
                    # Answered once its request's headers are in, not at once: a response written and closed before
                    # the client sent its request reaches most clients as a reset (a lost request), not a 429.
                    log.warning("refusing a connection from %s: %d open already", peer, limits.max_per_client)
                    self._refused = bytearray()
                    self._arm_header_timer()
                    return
                open_by_client[peer] = open_by_client.get(peer, 0) + 1
                self._counted_as = peer
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            if self._counted_as is not None:
                left = open_by_client.get(self._counted_as, 1) - 1
                if left > 0:
                    open_by_client[self._counted_as] = left
                else:
                    open_by_client.pop(self._counted_as, None)
                self._counted_as = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused is not None:  # over the cap: read up to the end of the headers, then say so
                self._refused += data
                if b"\r\n\r\n" in self._refused or len(self._refused) > REFUSED_HEADER_BYTES:
                    self._cancel_header_timer()
                    self.transport.write(refusal)
                    self.transport.close()
                return
            super().data_received(data)
            # uvicorn makes a request's cycle once its headers are complete; until then (or once the last response
            # is complete and bytes of a next request arrive) the header clock runs.
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                self._arm_header_timer()
            else:
                self._cancel_header_timer()

        def send_400_response(self, msg: str) -> None:
            log.warning("%s from %s", msg, self.client[0] if self.client else "?")
            self.transport.write(_MALFORMED)
            self.transport.close()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None and limits.header_timeout_s and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            cycle = None if self._refused is not None else self.cycle
            if (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                log.info("closed a connection from %s: no complete request headers within %g s",
                         self.client[0] if self.client else "?", limits.header_timeout_s)
                self.transport.close()

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol
