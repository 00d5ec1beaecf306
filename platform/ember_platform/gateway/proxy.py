"""Forward a request to a ready replica and stream its response back unchanged, chunk by chunk.

The replica is picked by a `ReplicaChooser`: round robin, or the KV-aware router (gateway/routing.py). A replica
that answers 503 or cannot be reached before any byte came back is skipped for another ready one. A client that
disconnects closes the upstream stream, which the replica sees as a disconnect and aborts the request (freeing its
KV blocks).

Pooled connections to a replica can go stale: a replica closes a connection idle for its keep-alive timeout, and
one that is stopping closes all of its idle ones. The pool drops idle connections well before a replica's timeout
(`POOL_KEEPALIVE_S` < replica/server.py's `KEEPALIVE_SECONDS`), and a request that meets a connection closed under
it, before any byte of an answer came back, goes once more to the same replica on a fresh connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx

from ember_platform.control.deployments import Deployment, Replica
from ember_platform.control.plane import ControlPlane, NoReplicaAvailable
from ember_platform.gateway.admission import Admission, Ticket
from ember_platform.gateway.errors import ProtocolError, error_body
from ember_platform.gateway.metrics import GatewayMetrics
from ember_platform.gateway.preprocess import PREPROCESSED_HEADER, RequestPreprocessor, preprocessed_marker
from ember_platform.gateway.responses import SSE_DONE, sse
from ember_platform.gateway.upstream import upstream_transport
from ember_platform.replica.auth import auth_headers

logger = logging.getLogger("ember.gateway")

# Not forwarded either way: hop-by-hop headers, and the ones uvicorn writes itself.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "server", "date"})
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
              httpx.WriteError)
# A connection the replica closed as the request went out, before it answered anything: it did not take the request.
_STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
POOL_KEEPALIVE_S = 30.0  # how long an idle connection to a replica stays pooled: well under a replica's keep-alive
DEFAULT_RETRY_AFTER_S = 2.0
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away; never sent, only counted


class ReplicaChooser(Protocol):
    """Picks the replica for one request (round robin, or the KV-aware router in gateway/routing.py)."""

    def remote_candidates(self, deployment: Deployment) -> list[Replica]:
        """Ready replicas this gateway does not run (other gateways', from shared routing tables)."""
        ...

    async def achoose(self, deployment: Deployment, candidates: Sequence[Replica], body: bytes,
                      request_id: str) -> Replica:
        """The replica for this request; whatever it reserves is held until `release(request_id)`."""
        ...

    def prefilled(self, request_id: str) -> None:
        """The replica's first bytes of the response came back: the request is past its prefill."""
        ...

    def release(self, request_id: str) -> None:
        """The request ended (or its attempt failed): give back what `achoose` reserved for it."""
        ...


class RoundRobin:
    """Every ready replica of a deployment in turn, whatever it holds; reserves nothing."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    def remote_candidates(self, deployment: Deployment) -> list[Replica]:
        return []

    async def achoose(self, deployment: Deployment, candidates: Sequence[Replica], body: bytes,
                      request_id: str) -> Replica:
        counter = self._counters.setdefault(deployment.name, itertools.count())
        return candidates[next(counter) % len(candidates)]

    def prefilled(self, request_id: str) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


class Proxy:
    def __init__(self, plane: ControlPlane, metrics: GatewayMetrics, *, chooser: ReplicaChooser | None = None,
                 connect_timeout: float = 5.0, admission: Admission | None = None) -> None:
        """`admission`: the gates requests pass before they go to a replica (gateway/admission.py); None admits
        everything (the engines then queue what they cannot run)."""
        self.plane = plane
        self.metrics = metrics
        self.chooser = chooser or RoundRobin()
        self.admission = admission
        self.connect_timeout = connect_timeout
        self.preprocessor = RequestPreprocessor()  # request hooks, before routing hashes the prompt
        # Streams hold their connection for as long as they run: no pool limit, the replicas queue themselves.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=POOL_KEEPALIVE_S)
        self.client = httpx.AsyncClient(transport=upstream_transport(limits), limits=limits)

    async def aclose(self) -> None:
        if self.admission is not None:
            await self.admission.aclose()
        await self.client.aclose()
        self.preprocessor.close()

    async def forward(self, name: str, path: str, body: bytes, *, request_id: str, endpoint: str,
                      received_at: float, receive: Callable, key: str | None = None,
                      payload: dict[str, Any] | None = None) -> UpstreamResponse | None:
        """Open `path` on a replica of deployment NAME; raises ControlError subclasses when none can take it (or the
        admission gate turns the request away: QueueFull, NoReplicaAvailable). `key`: the API key's name, for the
        gate's per-key limit. `payload`: `body` parsed, if the caller has it (the request hooks may change it).

        Returns None when the client left first: while the request waited for a replica, or for the response
        headers (which a replica sends only at the end of an answer that is not streamed); the request is then
        cancelled, which closes its connection to the replica, which aborts it.
        """
        opening = asyncio.ensure_future(self._admit_and_open(name, path, body, request_id, endpoint, received_at,
                                                             key, payload))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({opening, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not opening.done():
                opening.cancel()
            await asyncio.gather(opening, watch, return_exceptions=True)
        if opening.cancelled():
            logger.info("client left before the response of %s started; request cancelled", name)
            self.metrics.count(name, endpoint, CLIENT_CLOSED)
            return None
        return opening.result()

    async def _admit_and_open(self, name: str, path: str, body: bytes, request_id: str, endpoint: str,
                              received_at: float, key: str | None,
                              payload: dict[str, Any] | None = None) -> UpstreamResponse:
        """A place in NAME's admission gate, then the replica's response; the place goes back when the response ends
        (the finisher), or here on every other way out (refused, failed, cancelled).

        The request hooks run first (gateway/preprocess.py): a request they refuse takes no place in the gate."""
        dep = self.plane.get(name)
        bodies = {dep.active_version: await self.preprocessor.prepare(dep.active, body, payload=payload,
                                                                      timeout=dep.request_timeout)}
        if self.admission is None:
            return await self._open(name, path, body, bodies, request_id, endpoint, received_at, None)
        ticket = await self.admission.gate(dep).admit(key)
        try:
            return await self._open(name, path, body, bodies, request_id, endpoint, received_at, ticket)
        except BaseException:
            ticket.release()
            raise

    async def _open(self, name: str, path: str, body: bytes, bodies: dict[str, bytes], request_id: str,
                    endpoint: str, received_at: float, ticket: Ticket | None) -> UpstreamResponse:
        """`body`: as the client sent it; `bodies`: after each version's request hooks (filled as needed)."""
        tried: set[str] = set()
        retry_after: float | None = None
        candidates = await self._candidates(name, admitted=ticket is not None)
        while True:
            dep = self.plane.get(name)
            # Routing hashes the prompt the model will see: the active version's hooks rewrote it.
            routed = await self._preprocessed(dep, dep.active_version, body, bodies)
            replica = await self.chooser.achoose(dep, candidates, routed, request_id)
            tried.add(replica.id)
            content, marker = await self._outgoing(dep, replica, body, bodies)
            request = self.client.build_request(
                "POST", f"{replica.url}{path}", content=content,
                headers={"content-type": "application/json", "x-request-id": request_id,
                         **auth_headers(replica.secret), **marker},
                timeout=httpx.Timeout(dep.request_timeout, connect=self.connect_timeout))
            replica.in_flight += 1
            sent = time.monotonic()
            try:
                response = await self._send(request, name)
            except _RETRYABLE as e:
                replica.in_flight -= 1
                self.chooser.release(request_id)
                logger.warning("%s: replica %s at %s unreachable (%s); trying another", name, replica.id,
                               replica.url, e)
                self.plane.report_unreachable(dep, replica)
                response = None
            except httpx.TimeoutException:
                replica.in_flight -= 1
                self.chooser.release(request_id)
                raise ProtocolError(504, f"The replica of '{name}' did not answer within the model's request "
                                         f"timeout ({dep.request_timeout:.0f} s).", None, "upstream_timeout") from None
            except httpx.HTTPError as e:
                replica.in_flight -= 1
                self.chooser.release(request_id)
                raise ProtocolError(502, f"The replica of '{name}' failed: {type(e).__name__}: {e}", None,
                                    "upstream_error", type="server_error") from None
            except BaseException:
                replica.in_flight -= 1
                self.chooser.release(request_id)
                raise
            if response is not None and response.status_code == 503:
                retry_after = _retry_after(response) or retry_after
                await response.aclose()
                replica.in_flight -= 1
                self.chooser.release(request_id)
                self.plane.report_unavailable(dep, replica)
                response = None
            if response is not None:
                self.metrics.upstream_latency.labels(name).observe(time.monotonic() - sent)
                return UpstreamResponse(response, replica,
                                        self._finisher(name, endpoint, replica, received_at, request_id, ticket),
                                        on_first_chunk=lambda: self.chooser.prefilled(request_id))
            self.metrics.upstream_retries.labels(name).inc()
            candidates = [r for r in await self._candidates(name, wait=False) if r.id not in tried]
            if not candidates and ticket is not None and not any(r.id in tried for r in dep.ready_replicas()):
                # The replicas tried died or are draining: wait for a replacement, as a cold start does, rather than
                # fail a request that was admitted (it still holds its place, so the wait is bounded by the gate).
                # A tried replica that is still ready (alive, but it failed this request) gets no such wait: 503.
                candidates = await self.plane.acquire(name, exclude=tried, admitted=True)
            if not candidates:
                raise NoReplicaAvailable(
                    f"No replica of '{name}' can take the request now: the replicas tried are draining or "
                    f"unreachable. Please retry shortly.", retry_after=retry_after or DEFAULT_RETRY_AFTER_S)

    async def _preprocessed(self, dep: Deployment, version: str, body: bytes, bodies: dict[str, bytes]) -> bytes:
        """`body` after `version`'s request hooks, run once per request and version (versions change only in a
        rollout, between two attempts)."""
        if version not in bodies:
            bodies[version] = await self.preprocessor.prepare(dep.versions[version], body,
                                                              timeout=dep.request_timeout)
        return bodies[version]

    async def _outgoing(self, dep: Deployment, replica: Replica, body: bytes,
                        bodies: dict[str, bytes]) -> tuple[bytes, dict[str, str]]:
        """What goes to `replica`: the body its version's hooks rewrote, with the header that says they ran, to a
        replica that requires the secret (it trusts the header only then); the client's body to any other, which
        runs the hooks itself."""
        version = dep.versions.get(replica.version)
        if replica.secret is None or version is None:
            return body, {}
        content = await self._preprocessed(dep, replica.version, body, bodies)
        return content, {PREPROCESSED_HEADER: preprocessed_marker(version.manifest, version.digest)}

    async def _send(self, request: httpx.Request, name: str) -> httpx.Response:
        try:
            return await self.client.send(request, stream=True)
        except _STALE_CONNECTION as e:
            # Nothing came back, so the replica did not take the request (it closed a pooled connection as the request
            # went out): sending it again is safe. The pool has dropped that connection; this takes a fresh one or
            # another live one. A replica that is really gone fails again, and the caller tries another.
            logger.info("%s: connection to %s closed before any answer (%s: %s); sending the request again",
                        name, request.url.netloc.decode("ascii", "replace"), type(e).__name__, e)
            return await self.client.send(request, stream=True)

    async def _candidates(self, name: str, *, wait: bool = True, admitted: bool = False) -> list[Replica]:
        """Ready replicas for a request: this gateway's own, and with shared routing tables those of other
        gateways too (then a gateway that runs none routes to them instead of starting one). Otherwise the
        control plane's bounded queue, which cold-starts a deployment scaled to zero."""
        dep = self.plane.get(name)
        found = [*dep.ready_replicas(), *self.chooser.remote_candidates(dep)]
        if found or not wait:
            return found
        return await self.plane.acquire(name, admitted=admitted)

    def _finisher(self, name: str, endpoint: str, replica: Replica, received_at: float,
                  request_id: str, ticket: Ticket | None) -> Callable[[int], None]:
        def finish(status: int) -> None:
            if ticket is not None:
                ticket.release()
            self.chooser.release(request_id)
            replica.in_flight -= 1
            replica.served += 1
            self.metrics.count(name, endpoint, status)
            self.metrics.request_duration.labels(name).observe(time.monotonic() - received_at)

        return finish


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


class UpstreamResponse:
    """An ASGI response that relays an open httpx stream as it arrives, and closes it when the client leaves.

    An SSE stream is relayed in whole events (a chunk's unfinished last event waits for its end), so that when the
    replica breaks off mid-stream (it died, or the connection did) the client still gets a well-formed ending: an
    OpenAI-style error event, `data: [DONE]`, and the end of the body, not a cut chunked body.
    """

    def __init__(self, upstream: httpx.Response, replica: Replica, on_finish: Callable[[int], None], *,
                 on_first_chunk: Callable[[], None] | None = None) -> None:
        self.upstream = upstream
        self.replica = replica
        self.on_finish = on_finish
        self.on_first_chunk = on_first_chunk
        self.status_code = upstream.status_code
        self.event_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
        self._started = False  # the response's headers went out
        self._ended = False    # its last body message went out

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        headers = [(k, v) for k, v in self.upstream.headers.raw if k.decode("latin-1").lower() not in _HOP_BY_HOP]
        relay = asyncio.ensure_future(self._relay(send, headers))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done() and not relay.done():
                logger.info("client left; closing the stream from replica %s", self.replica.id)
                relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay  # re-raises an upstream error that happened mid-stream
        except (httpx.HTTPError, OSError) as e:
            # Headers are out already: an event stream ends with an error event the client's SSE parser reads (the
            # OpenAI client raises it as an APIError); any other body can only be cut short, which the client sees.
            logger.warning("stream from replica %s broke off: %s", self.replica.id, e)
            if self.event_stream and self._started and not self._ended and not watch.done():
                with contextlib.suppress(OSError):
                    await send({"type": "http.response.body", "body": _broken_stream_events(), "more_body": False})
                    self._ended = True
        finally:
            for task in (relay, watch):
                task.cancel()
            await asyncio.gather(relay, watch, return_exceptions=True)
            await self.upstream.aclose()  # before the whole response arrived, this closes the connection
            self.on_finish(self.status_code)

    async def _relay(self, send: Callable, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        self._started = True
        first, self.on_first_chunk = self.on_first_chunk, None
        held = b""  # an SSE event begun in the last chunk, sent once it is whole
        async for chunk in self.upstream.aiter_raw():
            if first is not None:  # a streamed answer's first token (a whole one's end): the prefill is over
                first()
                first = None
            if self.event_stream:
                chunk, held = _whole_events(held + chunk)
                if not chunk:
                    continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self._ended = True
        await send({"type": "http.response.body", "body": held, "more_body": False})


def _whole_events(data: bytes) -> tuple[bytes, bytes]:
    """`data` split after its last complete SSE event (a blank line ends one): what can go out, what waits."""
    end = data.rfind(b"\n\n")
    return (data, b"") if end == len(data) - 2 else (data[:end + 2], data[end + 2:])


def _broken_stream_events() -> bytes:
    """The end of an event stream whose replica broke off: one error event, then `[DONE]`."""
    error = error_body("The replica serving this stream stopped before the answer finished (it may have failed or "
                       "been stopped); the text so far is incomplete. Please retry the request.", "server_error",
                       None, "upstream_disconnected")
    return sse(error) + SSE_DONE


async def _wait_for_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
