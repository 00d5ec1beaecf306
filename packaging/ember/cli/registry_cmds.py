"""`ember push`, `ember pull`, `ember ls`: move packages to and from a registry."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ember.cli.output import console, human_size

if TYPE_CHECKING:
    from ember.registry import PullResult, PushResult

REGISTRY_HELP = "a directory or s3://BUCKET/PREFIX (default: $EMBER_REGISTRY, else ~/.ember/registry)"
ENDPOINT_HELP = "S3 endpoint for MinIO, R2 and the like (default: $AWS_ENDPOINT_URL, else AWS)"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("push", help="build a package and upload it to a registry",
                       description="Build DIR (validate it and write ember.lock), upload the blobs the "
                       "registry does not have yet, then publish NAME:VERSION. Versions are immutable.")
    p.add_argument("dir", type=Path, metavar="DIR", help="package directory")
    _registry_options(p)
    p.add_argument("--force", action="store_true",
                   help="replace NAME:VERSION even if the registry holds different content for it")
    p.add_argument("--version", dest="as_version", metavar="VERSION",
                   help="publish as this version instead of [model] version (the files, and so the package "
                   "digest, are unchanged: only what differs from earlier versions is uploaded)")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", help="download a package from a registry",
                       description="Download NAME[:VERSION] (the latest version when omitted) through the "
                       "local blob cache ($EMBER_CACHE, else ~/.ember/cache), verify every digest, and "
                       "create DIR only once the whole package checks out.")
    p.add_argument("reference", metavar="NAME[:VERSION]", help="e.g. tiny or tiny:0.1.0")
    _registry_options(p)
    p.add_argument("--to", type=Path, metavar="DIR", required=True,
                   help="directory to create (must not exist, or be empty)")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("ls", help="list the packages in a registry",
                       description="List every version of every package in a registry, with its digest "
                       "and size.")
    _registry_options(p)
    p.set_defaults(func=cmd_ls)


def _registry_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", metavar="URL", help=REGISTRY_HELP)
    p.add_argument("--endpoint-url", metavar="URL", help=ENDPOINT_HELP)


def _blobs(n: int) -> str:
    return f"{n} blob{'' if n == 1 else 's'}"


def push_summary(result: PushResult) -> str:
    from ember.registry import short_digest

    ref, digest = result.lock.reference, short_digest(result.lock.digest)
    if result.already_pushed:
        return f"{ref} ({digest}) already pushed to {result.registry_url}; nothing to upload"
    return (f"pushed {ref} ({digest}) to {result.registry_url}: {_blobs(len(result.uploaded))} uploaded "
            f"({human_size(result.uploaded_bytes)}), {result.already_present} already in the registry")


def pull_summary(result: PullResult) -> str:
    from ember.registry import short_digest

    return (f"pulled {result.lock.reference} ({short_digest(result.lock.digest)}) to {result.dest}: "
            f"{_blobs(len(result.downloaded))} downloaded ({human_size(result.downloaded_bytes)}), "
            f"{result.from_cache} from the cache")


def cmd_push(args: argparse.Namespace) -> int:
    from ember.registry import open_registry, push_package

    result = push_package(args.dir, open_registry(args.registry, args.endpoint_url), force=args.force,
                          version=args.as_version)
    console.print(push_summary(result), markup=False)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from ember.registry import open_registry, pull_package

    result = pull_package(args.reference, open_registry(args.registry, args.endpoint_url), args.to)
    console.print(pull_summary(result), markup=False)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from ember.registry import list_packages, open_registry, short_digest

    registry = open_registry(args.registry, args.endpoint_url)
    packages = list_packages(registry)
    if not packages:
        console.print(f"no packages in {registry.url}", markup=False)
        return 0
    table = Table(title=escape(registry.url), title_justify="left")
    for column in ("package", "version", "digest"):
        table.add_column(column)
    table.add_column("size", justify="right")
    table.add_column("files", justify="right")
    for info in packages:
        if info.lock is None:
            problem = f"[red]unreadable: {escape(info.problem or '')}[/red]"
            table.add_row(info.name, info.version, problem, "", "")
        else:
            table.add_row(info.name, info.version, short_digest(info.lock.digest),
                          human_size(info.lock.total_size), str(len(info.lock.files)))
    console.print(table)
    return 0
