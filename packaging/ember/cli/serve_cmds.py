"""`ember serve`, `deploy`, `call`, `keys`: run the platform, deploy to it, call a model, manage API keys.

`ember` never imports the platform: `ember serve` loads it through an entry point (`platform_command`), so that
`ember --help`, `ember keys` and the packaging commands run where only the base install is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ember.cli.output import console, err_console
from ember.cli.registry_cmds import ENDPOINT_HELP, REGISTRY_HELP
from ember.errors import EmberError

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
GATEWAY_ENV = "EMBER_GATEWAY"
API_KEY_ENV = "EMBER_API_KEY"
ADMIN_KEY_ENV = "EMBER_ADMIN_KEY"
DEPLOY_TIMEOUT_S = 900.0
PLATFORM_COMMANDS = "ember.platform"  # entry-point group: the platform's implementations of CLI commands


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the gateway, the control plane and replicas on this machine",
                       description="Serve models over OpenAI-compatible HTTP. Each PACKAGE_DIR is built, pushed to "
                       "the registry and deployed; more can be deployed later with `ember deploy`. Ctrl-C drains "
                       "the replicas and exits. State (API keys, pulled packages, replica logs) lives in "
                       "$EMBER_HOME/serve (default ~/.ember/serve).")
    p.add_argument("dirs", nargs="*", type=Path, metavar="PACKAGE_DIR", help="package directories to deploy (a "
                   "plain Hugging Face checkpoint directory is served with a generated manifest)")
    p.add_argument("--dev", action="store_true", help="serve the package directories as they are now, each under a "
                   "version derived from its content (e.g. 0.1.0+dev.1a2b3c4d5e6f), so that an edit needs no "
                   "version bump")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000; 0 picks a free one)")
    p.add_argument("--registry", metavar="URL", help=REGISTRY_HELP)
    p.add_argument("--endpoint-url", metavar="URL", help=ENDPOINT_HELP)
    p.add_argument("--redis-url", metavar="URL", help="routing tables in Redis, shared with other gateways and "
                   "replicas (default: in-process tables); EMBER_ROUTING=round-robin turns KV-aware routing off")
    p.add_argument("--no-auth", action="store_true", help="accept requests without API keys (local development "
                   "only: anyone who can reach the port can use and administer every model)")
    p.add_argument("--launcher", metavar="NAME", default=os.environ.get("EMBER_LAUNCHER") or "local",
                   help="the launcher plugin that runs the replicas (default: $EMBER_LAUNCHER, else local: child "
                   "processes on this machine); `ember plugins` lists the installed ones")
    p.add_argument("--launcher-option", action="append", default=[], metavar="KEY=VALUE", type=_key_value,
                   help="a setting of the launcher, e.g. gpus=0,1 for local (repeatable)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("deploy", help="deploy a registry package to a running gateway",
                       description="Ask the gateway's control plane to deploy NAME[:VERSION] (the latest version when "
                       "omitted) from its registry: the new version's replicas start, then the old version's drain.")
    p.add_argument("reference", metavar="NAME[:VERSION]", help="e.g. tiny-llama or tiny-llama:0.2.0")
    _gateway_option(p)
    p.add_argument("--admin-key", metavar="KEY", help=f"the admin key (default: ${ADMIN_KEY_ENV})")
    p.add_argument("--min-replicas", type=int, metavar="N", help="override [scaling] min_replicas")
    p.add_argument("--max-replicas", type=int, metavar="N", help="override [scaling] max_replicas")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser("call", help="stream a completion from a served model",
                       description="Send PROMPT to model NAME through the gateway with the OpenAI client and print "
                       "the answer as it streams.")
    p.add_argument("model", metavar="NAME", help="model name (NAME or NAME:ADAPTER)")
    p.add_argument("prompt", metavar="PROMPT")
    _gateway_option(p)
    p.add_argument("--api-key", metavar="KEY", help=f"API key (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="longest answer in tokens (default: 64)")
    p.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default: the model's)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="send PROMPT as a user message to /v1/chat/completions (default)")
    mode.add_argument("--completion", dest="chat", action="store_false",
                      help="send PROMPT as raw text to /v1/completions")
    p.set_defaults(func=cmd_call)

    p = sub.add_parser("keys", help="create or revoke API keys",
                       description="API keys for `ember serve`, stored only as sha256 hashes in "
                       "$EMBER_HOME/serve/keys.json (default ~/.ember/serve/keys.json). A running gateway picks "
                       "changes up at once.")
    keys = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    k = keys.add_parser("create", help="create a key and print it (once)")
    k.add_argument("--name", help="a name to revoke it by later (default: key-N)")
    k.add_argument("--admin", action="store_true", help="an admin key (allowed on /admin/...)")
    k.set_defaults(func=cmd_keys_create)
    k = keys.add_parser("revoke", help="revoke a key by its value or its name")
    k.add_argument("key", metavar="KEY_OR_NAME")
    k.set_defaults(func=cmd_keys_revoke)
    k = keys.add_parser("list", help="list keys (names and creation times; keys themselves are not stored)")
    k.set_defaults(func=cmd_keys_list)


def _gateway_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", metavar="URL", help=f"the gateway (default: ${GATEWAY_ENV}, else {DEFAULT_GATEWAY})")


def _gateway(args: argparse.Namespace) -> str:
    """The gateway's base URL. `127.0.0.1:8000` (as `ember serve` prints its address) means http://127.0.0.1:8000:
    without a scheme httpx would take the host for one and fail with "unreachable"."""
    url = (args.gateway or os.environ.get(GATEWAY_ENV) or DEFAULT_GATEWAY).strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url


def cmd_serve(args: argparse.Namespace) -> int:
    serve = platform_command("serve")
    return serve(args.dirs, host=args.host, port=args.port, registry_url=args.registry,
                 endpoint_url=args.endpoint_url, no_auth=args.no_auth, redis_url=args.redis_url,
                 log_level=args.log_level, say=lambda line: err_console.print(line, markup=False),
                 launcher=args.launcher, launcher_options=dict(args.launcher_option), dev=args.dev)


def platform_command(name: str) -> Any:
    """The platform's implementation of `ember NAME`, found through the "ember.platform" entry-point group.

    `ember` never imports the platform (a model author's install has no torch): the platform registers its commands
    into this group (pyproject.toml), as plugins register techniques into "ember".
    """
    import importlib.metadata

    found = importlib.metadata.entry_points(group=PLATFORM_COMMANDS, name=name)
    if not found:
        raise EmberError(f"`ember {name}` needs the serving platform, which is not installed here: "
                         "pip install 'ember[serve]'")
    entry = next(iter(found))
    try:
        return entry.load()
    except ImportError as e:
        raise EmberError(f"`ember {name}` needs the serving platform's dependencies ({e}): "
                         "pip install 'ember[serve]'") from e


def _key_value(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _error_message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text.strip() or f"HTTP {response.status_code}"


def cmd_deploy(args: argparse.Namespace) -> int:
    import httpx

    gateway = _gateway(args)
    key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    body: dict[str, Any] = {"reference": args.reference}
    if args.min_replicas is not None:
        body["min_replicas"] = args.min_replicas
    if args.max_replicas is not None:
        body["max_replicas"] = args.max_replicas
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    err_console.print(f"deploying {args.reference} to {gateway} (waits for its replicas to be ready)", markup=False)
    try:
        response = httpx.post(f"{gateway}/admin/deployments", json=body, headers=headers,
                              timeout=httpx.Timeout(DEPLOY_TIMEOUT_S, connect=10.0))
    except httpx.HTTPError as e:
        raise EmberError(f"cannot reach the gateway at {gateway}: {e}; is `ember serve` running?") from None
    if response.status_code >= 400:
        raise EmberError(f"{gateway}: {response.status_code}: {_error_message(response)}")
    dep = response.json()
    ready = sum(1 for r in dep["replicas"] if r["state"] == "ready" and r["version"] == dep["active_version"])
    console.print(f"{dep['name']}:{dep['active_version']} ({dep['digest'][:19]}) is active with {ready} ready "
                  f"replica(s); call it with `ember call {dep['name']} \"Hello\"`", markup=False)
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    import openai

    gateway = _gateway(args)
    key = args.api_key or os.environ.get(API_KEY_ENV)
    # The client insists on a key; "none" gets a gateway without auth (--no-auth) through, and a 401 is explained.
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key or "none", max_retries=0, timeout=600.0)
    extra: dict[str, Any] = {}
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    try:
        if args.chat:
            stream = client.chat.completions.create(
                model=args.model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
                stream=True, **extra)
            pieces = (chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        else:
            stream = client.completions.create(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                                               stream=True, **extra)
            pieces = (chunk.choices[0].text or "" for chunk in stream if chunk.choices)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except openai.APIConnectionError:
        raise EmberError(f"cannot reach the gateway at {gateway}; is `ember serve` running?") from None
    except openai.AuthenticationError as e:
        if not key:
            raise EmberError(f"the gateway at {gateway} requires an API key and none was given: pass --api-key KEY "
                             f"or set ${API_KEY_ENV} (`ember keys create` makes one)") from None
        raise EmberError(f"{e.status_code}: {_error_message(e.response)}") from None
    except openai.APIStatusError as e:
        raise EmberError(f"{e.status_code}: {_error_message(e.response)}") from None
    sys.stdout.write("\n")
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    from ember.keys import KeyStore

    store = KeyStore.default()
    key = store.create(args.name, admin=args.admin)
    err_console.print(f"created {'admin ' if args.admin else ''}key {json.dumps(store.records()[-1].name)} in "
                      f"{store.path}; it is shown only now:", markup=False)
    print(key)
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from ember.keys import KeyStore

    store = KeyStore.default()
    gone = store.revoke(args.key)
    console.print(f"revoked {', '.join(repr(r.name) for r in gone)}", markup=False)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    import time

    from ember.keys import KeyStore

    store = KeyStore.default()
    records = store.records()
    if not records:
        console.print(f"no keys in {store.path}", markup=False)
    for record in records:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        console.print(f"{record.name}\t{'admin' if record.admin else 'api'}\tcreated {created}", markup=False)
    return 0
