"""`ember push`, `ember pull`, `ember ls`: move packages to and from a registry."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.filesize import decimal as format_size
from rich.markup import escape
from rich.table import Table

from ember.registry import (
    list_packages,
    open_registry,
    pull_package,
    push_package,
    short_digest,
)

REGISTRY_HELP = ("a directory or s3://BUCKET/PREFIX (default: $EMBER_REGISTRY, else ~/.ember/registry)")
ENDPOINT_HELP = "S3 endpoint for MinIO, R2 and the like (default: $AWS_ENDPOINT_URL, else AWS)"


def register(subparsers: argparse._SubParsersAction) -> None:
    push = subparsers.add_parser(
        "push", help="build a package and upload it to a registry",
        description="Build DIR (validate it and write ember.lock), upload the blobs the registry does not "
                    "have yet, then publish NAME:VERSION. Versions are immutable.")
    push.add_argument("dir", metavar="DIR", type=Path, help="the package directory")
    _registry_options(push)
    push.add_argument("--force", action="store_true",
                      help="replace NAME:VERSION even if the registry holds different content for it")
    push.set_defaults(func=run_push)

    pull = subparsers.add_parser(
        "pull", help="download a package from a registry",
        description="Download NAME[:VERSION] (the latest version when omitted) through the local blob "
                    "cache ($EMBER_CACHE, else ~/.ember/cache), verify every digest, and create DIR.")
    pull.add_argument("reference", metavar="NAME[:VERSION]", help="e.g. tiny or tiny:0.1.0")
    _registry_options(pull)
    pull.add_argument("--to", metavar="DIR", type=Path, required=True,
                      help="directory to create (must not exist, or be empty)")
    pull.set_defaults(func=run_pull)

    ls = subparsers.add_parser("ls", help="list the packages in a registry",
                               description="List every package version in a registry.")
    _registry_options(ls)
    ls.set_defaults(func=run_ls)


def _registry_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--registry", metavar="URL", help=REGISTRY_HELP)
    parser.add_argument("--endpoint-url", metavar="URL", help=ENDPOINT_HELP)


def run_push(args: argparse.Namespace) -> int:
    registry = open_registry(args.registry, args.endpoint_url)
    result = push_package(args.dir, registry, force=args.force)
    print(result.summary())
    return 0


def run_pull(args: argparse.Namespace) -> int:
    registry = open_registry(args.registry, args.endpoint_url)
    result = pull_package(args.reference, registry, args.to)
    print(result.summary())
    return 0


def run_ls(args: argparse.Namespace) -> int:
    registry = open_registry(args.registry, args.endpoint_url)
    packages = list_packages(registry)
    console = Console()
    if not packages:
        console.print(f"no packages in {registry.url}", highlight=False)
        return 0
    table = Table(title=registry.url, title_justify="left")
    table.add_column("package")
    table.add_column("version")
    table.add_column("digest")
    table.add_column("size", justify="right")
    table.add_column("files", justify="right")
    for info in packages:
        if info.lock is None:
            problem = f"[red]unreadable: {escape(info.problem or '')}[/red]"
            table.add_row(info.name, info.version, problem, "", "")
        else:
            table.add_row(info.name, info.version, short_digest(info.lock.digest),
                          format_size(info.lock.total_size), str(len(info.lock.files)))
    console.print(table)
    return 0
