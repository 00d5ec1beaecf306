"""`ember serve`: the gateway, the control plane and local replica processes on one machine, with embedded defaults
(a local registry, in-process routing). Ctrl-C or SIGTERM drains the replicas and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import uvicorn

from ember.errors import EmberError
from ember.launch import LaunchSettings
from ember.package.scaffold import is_plain_checkpoint, package_for_checkpoint
from ember.registry import BlobCache, PushResult, Registry, VersionConflict, open_registry, push_package, short_digest
from ember_platform.control.home import serve_home
from ember_platform.control.launchers import DEFAULT_LAUNCHER, build_launcher
from ember_platform.control.plane import ControlPlane
from ember_platform.gateway.app import create_app
from ember_platform.gateway.auth import ADMIN_KEY_ENV, Authenticator, KeyStore
from ember_platform.gateway.connections import ConnectionLimits, guarded_protocol
from ember_platform.gateway.proxy import ReplicaChooser, RoundRobin
from ember_platform.replica.auth import cluster_secret
from ember_platform.routing import RoutingTables

logger = logging.getLogger("ember.serve")

READY_LINE = "EMBER_SERVE_READY"
ROUTING_ENV = "EMBER_ROUTING"  # "kv" (default: prefix + load + lora scorers) or "round-robin"
GRACEFUL_SHUTDOWN_S = 30.0
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a caught SIGTERM after shutting down, which would end the process with -15: here Ctrl-C
        # and SIGTERM both mean "drain and exit 0".
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """Listen before anything starts, so a taken port is an error up front (and port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise EmberError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _authenticator(home: Path, no_auth: bool, host: str, say: Callable[[str], None]) -> Authenticator | None:
    if no_auth:
        exposed = "" if host in LOOPBACK else f" — and {host} is reachable from other machines"
        say(f"WARNING: --no-auth: anyone who can reach this server can call and administer every model{exposed}. "
            "Use it for local development only.")
        return None
    store = KeyStore(home / "keys.json")
    if not os.environ.get(ADMIN_KEY_ENV):
        key = store.ensure_admin_key()
        if key is not None:
            say(f"admin key (shown only now; stored hashed in {store.path}): {key}")
    if not any(not r.admin for r in store.records()):
        say("no API keys yet: create one with `ember keys create` (the admin key works too)")
    return Authenticator.from_env(store)


def _routing(redis_url: str | None, say: Callable[[str], None],
             replica_secret: str | None = None) -> tuple[RoutingTables, ReplicaChooser]:
    """The routing tables (Redis, shared with other gateways, or in-process ones) and the gateway's routing over them:
    KV-aware, or round robin. The control plane writes its deployments' states to the same tables.
    `replica_secret`: the cluster secret, for the replicas of other gateways found in shared tables."""
    policy = os.environ.get(ROUTING_ENV, "kv")
    if policy not in ("kv", "round-robin"):
        raise EmberError(f"{ROUTING_ENV}={policy!r}: expected 'kv' or 'round-robin'")
    from ember_platform.gateway.routing import KVAwareChooser
    from ember_platform.routing import Router, RoutingError, open_tables

    try:
        tables = open_tables(redis_url)
        if redis_url:
            tables.snapshot("-")  # reach Redis now: a wrong URL is a one-line error, not a failure per request
    except RoutingError as e:
        raise EmberError(f"--redis-url {redis_url}: {e}") from None
    if policy == "round-robin" and not redis_url:  # shared tables need the chooser even for round robin; in-process
        return tables, RoundRobin()                  # ones then hold only the control plane's deployment states
    if redis_url:
        say(f"routing tables in Redis at {redis_url} ({policy} routing)")
    return tables, KVAwareChooser(Router.from_config(tables), observe_routing=redis_url is None, policy=policy,
                                  replica_secret=replica_secret)


def _push(package_dir: Path, registry: Registry, home: Path, dev: bool, say: Callable[[str], None]) -> PushResult:
    """Push one PACKAGE_DIR argument of `ember serve`; a broken package fails here, before anything listens."""
    source = Path(package_dir)
    if is_plain_checkpoint(source):
        package_dir = package_for_checkpoint(source, home / "checkpoints")
        say(f"{source} is a Hugging Face checkpoint without an ember.toml: serving it with a generated manifest "
            f"({package_dir / 'ember.toml'}); to choose its settings, `ember init PACKAGE_DIR --from {source}`")
        dev = True  # the generated manifest's version says nothing about the checkpoint's content
    try:
        pushed = push_package(package_dir, registry, dev=dev)
    except VersionConflict as e:
        raise e.with_remedy(f"or serve the working copy as it is: `ember serve --dev {source}` (a version "
                            f"derived from its content, e.g. {e.reference.partition(':')[2]}+dev.<digest>)") from None
    say(f"pushed {pushed.lock.reference} ({short_digest(pushed.lock.digest)}) to {registry.url}")
    return pushed


def serve(package_dirs: Sequence[Path] = (), *, host: str = "127.0.0.1", port: int = 8000,
          registry_url: str | None = None, endpoint_url: str | None = None, no_auth: bool = False,
          redis_url: str | None = None, log_level: str = "info", say: Callable[[str], None] | None = None,
          launcher: str = DEFAULT_LAUNCHER, launcher_options: Mapping[str, str] | None = None,
          dev: bool = False) -> int:
    """Build and push each package dir, then serve until interrupted, deploying them once the gateway listens.
    `launcher`: the installed launcher plugin that runs the replicas, built with `launcher_options`. `dev`: push
    each package under a version derived from its content (`dev_version`), so a working copy serves as it is. A
    plain Hugging Face checkpoint dir is served through a package generated for it (as `ember init` makes one).

    Prints `EMBER_SERVE_READY http://HOST:PORT` when every package's replicas are ready. Returns the exit code.
    """
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    home = serve_home()
    # Gateways that share Redis route to each other's replicas: all of them need one secret for the replicas.
    # Alone, a gateway gives each replica a fresh secret, unless $EMBER_REPLICA_SECRET chooses one.
    replica_secret = cluster_secret(home if redis_url else None)
    tables, chooser = _routing(redis_url, say, replica_secret)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness probe otherwise
    home.mkdir(parents=True, exist_ok=True)
    # An unknown launcher or option is refused here, before anything is pushed or listens.
    replica_launcher = build_launcher(launcher, LaunchSettings(home=home, redis_url=redis_url,
                                                               options=dict(launcher_options or {})))
    registry = open_registry(registry_url, endpoint_url)
    references = [_push(package_dir, registry, home, dev, say).lock.reference for package_dir in package_dirs]
    authenticator = _authenticator(home, no_auth, host, say)
    sock = bind(host, port)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"

    plane = ControlPlane(registry, packages_dir=home / "packages", cache=BlobCache.default(),
                         launcher=replica_launcher, replica_secret=replica_secret, routing_tables=tables)
    state: dict[str, object] = {"ready": False, "failed": None}
    server: _Server | None = None
    tasks: set[asyncio.Task[None]] = set()

    async def deploy_all() -> None:
        for _ in range(600):  # the gateway answers as soon as it listens; deployments come up behind it
            if server is not None and server.started:
                break
            await asyncio.sleep(0.05)
        try:
            await asyncio.gather(*(plane.deploy(reference) for reference in references))
        except Exception as e:
            logger.error("could not deploy: %s", e)
            state["failed"] = e
            assert server is not None
            server.should_exit = True
            return
        state["ready"] = True
        models = ", ".join(references) or "no models yet (deploy with `ember deploy NAME`)"
        say(f"serving {models} at {url} (replica logs: {home / 'logs'})")
        print(f"{READY_LINE} {url}", flush=True)

    async def on_startup() -> None:
        task = asyncio.create_task(deploy_all())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    app = create_app(plane, authenticator=authenticator, chooser=chooser, ready=lambda: bool(state["ready"]),
                     on_startup=on_startup)
    # Header and body read timeouts and a per-client connection cap (uvicorn has none): gateway/connections.py.
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            http=guarded_protocol(ConnectionLimits.from_env()))
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if state["failed"] is not None:
        return 1
    say("stopped: every replica drained")
    return 0


if __name__ == "__main__":
    from ember.cli.main import main

    sys.exit(main(["serve", *sys.argv[1:]]))
