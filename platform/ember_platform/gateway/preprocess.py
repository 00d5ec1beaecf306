"""`ember_preprocess_request` in the gateway: the package's and plugins' request hooks run here, before the prompt is
hashed for KV-aware routing, so that the router hashes the prompt the model will see (a hook that prepends a system
prompt no longer hides the prefix it shares with other requests).

Each request's hooks run once. The gateway sends the rewritten body with `PREPROCESSED_HEADER` naming the package
version whose hooks ran; a replica skips its own hooks only for a request that carries the replica secret (only a
gateway has it, replica/auth.py) and names its own version, so no client can skip them by calling a replica, and a
replica without a secret runs them on every request (the gateway then sends it the body as the client wrote it).

Per package version the gateway keeps one `PluginHost` (the installed plugins, then the package's `hooks.py`),
loaded on its first request in a worker thread; the hooks run in that pool too, never on the event loop. A hook that
fails answers that request 500 naming the plugin; the gateway and other requests go on.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.manifest import Manifest
from ember.plugins import PluginHost
from ember_platform.control.deployments import DeploymentVersion
from ember_platform.gateway import request_body
from ember_platform.gateway.errors import ProtocolError

log = logging.getLogger("ember.gateway.preprocess")

PREPROCESSED_HEADER = "x-ember-preprocessed"
HOOK = "ember_preprocess_request"
MAX_HOSTS = 64  # package versions whose plugin hosts stay loaded (like the routing tokenizers)


def preprocessed_marker(manifest: Manifest, digest: str | None) -> str:
    """What `PREPROCESSED_HEADER` carries: the package version (and digest) whose hooks rewrote the body."""
    return f"{manifest.reference}@{digest}" if digest else manifest.reference


class RequestPreprocessor:
    """Runs a deployment version's `ember_preprocess_request` chain on request bodies, off the event loop."""

    def __init__(self, workers: int = 4) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ember-preprocess")
        self._hosts: OrderedDict[Path, PluginHost] = OrderedDict()
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, version: DeploymentVersion, body: bytes, *, timeout: float,
                      payload: dict[str, Any] | None = None) -> bytes:
        """`body` after the version's hooks (re-encoded JSON), or `body` itself when no hook changed it.

        `payload`: `body` already parsed, which the hooks may then change in place (it saves parsing a large body
        again). Raises ProtocolError: 500 naming the plugin whose hook failed (or whose hooks.py cannot load), 504
        when the chain runs longer than `timeout`."""
        loop = asyncio.get_running_loop()
        host = self._hosts.get(version.package_dir)
        if host is None:
            host = await loop.run_in_executor(self._pool, self._host, version)
        if not host.pm.hook.ember_preprocess_request.get_hookimpls():
            return body
        future = loop.run_in_executor(self._pool, _run_chain, host, version.manifest, body, payload)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise ProtocolError(504, f"The request hooks ({HOOK}) of '{version.manifest.reference}' did not finish "
                                     f"within {timeout:.0f} s.", None, "request_hook_timeout") from None

    def _host(self, version: DeploymentVersion) -> PluginHost:
        with self._lock:  # one import of a package's hooks.py, however many requests arrive at once
            host = self._hosts.get(version.package_dir)
            if host is None:
                try:
                    host = PluginHost.for_package(version.package_dir)
                except EmberError as e:  # a broken plugin or hooks.py: this model's requests fail, not the gateway
                    log.error("cannot load the request hooks of %s: %s", version.manifest.reference, e)
                    raise _hook_failed(version.manifest, str(e)) from None
                self._hosts[version.package_dir] = host
                while len(self._hosts) > MAX_HOSTS:
                    self._hosts.popitem(last=False)
            return host


def _run_chain(host: PluginHost, manifest: Manifest, body: bytes, payload: dict[str, Any] | None) -> bytes:
    """The chain over one body (in a worker thread). The gateway has checked that the body is a JSON object.

    Encoding the result holds the GIL, the event loop's too, for tens of ms on a multi-megabyte prompt: a request
    the hooks left as it was (compared with a copy that shares its strings, so the copy costs little) goes on as
    the client's own bytes."""
    request = payload if payload is not None else request_body.loads(body)
    if not isinstance(request, dict):  # not expected here: the gateway refuses other bodies first
        return body
    sent = copy.deepcopy(request)
    try:
        result: Any = host.preprocess_request(request, manifest)
    except EmberError as e:  # PluginHost names the plugin: "package hooks.py: ember_preprocess_request raised ..."
        log.error("a request hook of %s failed: %s", manifest.reference, e)
        raise _hook_failed(manifest, str(e)) from None
    if result == sent:
        return body
    try:
        return json.dumps(result, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise _hook_failed(manifest, f"{HOOK} returned a request that is not JSON ({e})") from None


def _hook_failed(manifest: Manifest, detail: str) -> ProtocolError:
    return ProtocolError(500, f"A request hook of '{manifest.reference}' failed, so the request was not sent to the "
                              f"model: {detail}", None, "request_hook_failed", type="server_error")
