"""`python -m ember_platform.replica --package DIR ...`: one replica process serving one model package."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from ember.errors import EmberError
from ember_platform.replica.app import DEFAULT_STREAM_EVENT_RATE, MAX_STREAM_INTERVAL, Replica
from ember_platform.replica.auth import SECRET_ENV, new_secret
from ember_platform.replica.server import DEFAULT_DRAIN_TIMEOUT, READY_LINE, serve

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def parse_override(text: str) -> tuple[str, Any]:
    """`KEY=VALUE`, the value read as JSON when it is JSON (`8`, `true`, `{"bits": 4}`) and as a string otherwise."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ember_platform.replica",
        description=f"Serve one Ember package over HTTP (OpenAI-compatible). Prints '{READY_LINE} URL' once ready.")
    parser.add_argument("--package", required=True, metavar="DIR",
                        help="an Ember package dir (or a Hugging Face checkpoint dir)")
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
        # checks the package and overrides; loads nothing yet
        replica = Replica(args.package, dict(args.override), stream_event_rate=args.stream_event_rate)
    except (EmberError, OSError, TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve(replica, host=args.host, port=args.port, drain_timeout=args.drain_timeout, log_level=args.log_level,
                 redis_url=args.redis_url, secret=_secret(args.no_auth))


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
