"""`ember`: the entry point. Each subcommand lives in its own module with a `register()`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ember import __version__
from ember.errors import EmberError

# Modules under ember.cli, in the order their commands appear in `ember --help`.
COMMAND_MODULES = (
    "package_cmds",   # init, build, verify, schema
    "quantize_cmds",  # quantize
    "registry_cmds",  # push, pull, ls
    "plugin_cmds",    # plugins, explain
    "serve_cmds",     # serve, deploy, call, keys
)

DESCRIPTION = """\
Ember packages LLMs declaratively and serves them fast.

A package is a directory with an ember.toml manifest, a Hugging Face checkpoint in
safetensors, and optionally hooks.py (pluggy hooks that choose techniques for this model).
"""

EPILOG = """\
typical flow:
  ember init my-model --from ./hf-checkpoint   scaffold a package
  ember build my-model                         validate and write ember.lock
  ember explain my-model                       see which techniques would run it, and why
  ember push my-model --registry s3://bucket/ember
  ember pull my-model:0.1.0 --registry s3://bucket/ember --to ./deployed
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"ember.cli.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except EmberError as e:
        print(f"ember {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ember {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
