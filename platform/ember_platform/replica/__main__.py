"""`python -m ember_platform.replica --package DIR ...`: one replica process serving one model package.

Or `--registry URL --reference NAME:VERSION --digest sha256:...`, as launchers start it (ember.launch): the replica
checks the package out itself, through a blob cache on its machine, and refuses one with another digest."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember_platform.engine.config import override_value
from ember_platform.replica.auth import SECRET_ENV, new_secret
from ember_platform.replica.core import DEFAULT_STREAM_EVENT_RATE, MAX_STREAM_INTERVAL, Replica
from ember_platform.replica.server import DEFAULT_DRAIN_TIMEOUT, READY_LINE, serve

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def parse_override(text: str) -> tuple[str, Any]:
    """`KEY=VALUE`, the value read as JSON when it is JSON (`8`, `true`, `{"bits": 4}`) and as a string otherwise."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), override_value(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ember_platform.replica",
        description=f"Serve one Ember package over HTTP (OpenAI-compatible). Prints '{READY_LINE} URL' once ready.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--package", metavar="DIR", help="an Ember package dir (or a Hugging Face checkpoint dir)")
    source.add_argument("--registry", metavar="URL",
                        help="pull the package from this registry (a directory or s3://bucket/prefix); with "
                             "--reference and --digest")
    parser.add_argument("--reference", metavar="NAME:VERSION", help="with --registry: the package to serve")
    parser.add_argument("--digest", metavar="sha256:...", help="with --registry: the digest the package must have")
    parser.add_argument("--endpoint-url", metavar="URL", help="with an s3:// --registry: the S3 endpoint")
    parser.add_argument("--packages-dir", metavar="DIR", type=Path, default=None,
                        help="with --registry: where packages are checked out (default: $EMBER_HOME/serve/packages)")
    parser.add_argument("--blob-cache", metavar="DIR", type=Path, default=None,
                        help="with --registry: the blob cache pulls go through (default: the user's blob cache)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)")
    parser.add_argument("--override", action="append", type=parse_override, default=[], metavar="KEY=VALUE",
                        help="an engine override, e.g. max_num_seqs=8 or quantization=int8 (repeatable)")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT, metavar="S",
                        help="on SIGTERM, seconds to let requests in flight finish "
                             f"(default: {DEFAULT_DRAIN_TIMEOUT:g})")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's own choice); replicas sharing a host's cores "
                             "run far faster with fewer threads each than with too many")
    parser.add_argument("--stream-event-rate", type=float, default=DEFAULT_STREAM_EVENT_RATE, metavar="N",
                        help="the most server-sent events a second over all streams together (default: "
                             f"{DEFAULT_STREAM_EVENT_RATE:g}): with many streams open, each sends the tokens of "
                             f"several steps per event, at least every {MAX_STREAM_INTERVAL:g} s; 0 sends every "
                             "step's tokens")
    parser.add_argument("--redis-url", metavar="URL", default=None,
                        help="publish this replica (load, KV prefix blocks, adapters) to the routing tables in Redis "
                             "that gateways share; its id is $EMBER_REPLICA_ID or made up")
    parser.add_argument("--no-auth", action="store_true",
                        help=f"serve without a secret (local development only). Otherwise every request but "
                             f"/health, /ready and /metrics needs 'Authorization: Bearer <secret>': ${SECRET_ENV} "
                             "(how a gateway hands it over), else one made up now and printed on stderr")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.log_level == "trace" else getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    try:
        package = args.package or _checkout(args)
        # checks the package and overrides; loads nothing yet
        replica = Replica(package, dict(args.override), stream_event_rate=args.stream_event_rate)
    except (EmberError, OSError, TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve(replica, host=args.host, port=args.port, drain_timeout=args.drain_timeout, log_level=args.log_level,
                 redis_url=args.redis_url, secret=_secret(args.no_auth))


def _checkout(args: argparse.Namespace) -> Path:
    """The package a launcher named by registry reference and digest, checked out on this machine."""
    from ember.registry import BlobCache, checkout, open_registry
    from ember_platform.control.home import serve_home

    if not args.reference or not args.digest:
        raise EmberError("--registry needs --reference NAME:VERSION and --digest sha256:...")
    registry = open_registry(args.registry, args.endpoint_url)
    cache = BlobCache(args.blob_cache) if args.blob_cache else BlobCache.default()
    packages_dir = args.packages_dir or serve_home() / "packages"
    return checkout(registry, args.reference, packages_dir, cache, digest=args.digest).path


def _secret(no_auth: bool) -> str | None:
    """The secret requests must carry: from the environment (never argv, which `ps` shows), or made up and printed;
    None only when asked for with --no-auth, so that a replica never runs open by accident."""
    if no_auth:
        print("WARNING: --no-auth: any process that can reach this replica's port can generate, sleep and wake it. "
              "Use it for local development only.", file=sys.stderr, flush=True)
        return None
    secret = os.environ.pop(SECRET_ENV, "").strip()  # popped: nothing this process starts inherits it
    if not secret:
        secret = new_secret()
        print(f"replica secret (send 'Authorization: Bearer <secret>'; set ${SECRET_ENV} to choose it): {secret}",
              file=sys.stderr, flush=True)
    return secret


if __name__ == "__main__":
    sys.exit(main())
