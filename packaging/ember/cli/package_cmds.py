"""`ember init`, `build`, `verify`, `schema`: making and checking packages."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ember.cli.output import console, human_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="scaffold a package from a Hugging Face checkpoint",
                       description="Create a package directory: copy the checkpoint (safetensors only) into "
                       "DIR/weights and write an ember.toml filled from its config.json.")
    p.add_argument("dir", type=Path, metavar="DIR", help="package directory to create (must not exist or be empty)")
    p.add_argument("--from", dest="hf_dir", type=Path, required=True, metavar="HF_CHECKPOINT_DIR",
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)")
    p.add_argument("--name", help="package name (default: DIR's name)")
    p.add_argument("--version", default="0.1.0", help="package version (default: 0.1.0)")
    p.add_argument("--link", action="store_true", help="hardlink weight files instead of copying them")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("build", help="validate a package and write its ember.lock",
                       description="Validate ember.toml (including that every technique it names is "
                       "installed), refuse pickle checkpoints, and write ember.lock: every file's path, "
                       "size and sha256 and the package digest. Building twice gives the same bytes.")
    p.add_argument("dir", type=Path, metavar="DIR", help="package directory")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("verify", help="check a package's files against its ember.lock",
                       description="Re-hash every file and compare with ember.lock; refuse unsafe paths, "
                       "links out of the package, and files that are not in the lock.")
    p.add_argument("dir", type=Path, metavar="DIR", help="package directory")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("schema", help="print the JSON Schema of ember.toml (for editors)",
                       description="Print the JSON Schema of the manifest, e.g. for the Even Better TOML "
                       "editor extension.")
    p.set_defaults(func=cmd_schema)


def cmd_init(args: argparse.Namespace) -> int:
    from ember.package.scaffold import init_package

    target = init_package(args.dir, args.hf_dir, name=args.name, version=args.version, link=args.link)
    console.print(f"created package [bold]{target}[/] — edit {target / 'ember.toml'}, then "
                  f"`ember build {target}`")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from ember.package import build_package
    from ember.plugins import PluginHost

    host = PluginHost.for_package(args.dir)
    lock = build_package(args.dir, host)
    console.print(f"built [bold]{lock.reference}[/] {lock.digest} — {len(lock.files)} files, "
                  f"{human_size(lock.total_size)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ember.manifest import load_manifest
    from ember.package import verify_package

    lock = verify_package(args.dir)
    load_manifest(args.dir)  # its files are the locked ones; what it asks for must be what Ember can do
    console.print(f"verified [bold]{lock.reference}[/] {lock.digest} — {len(lock.files)} files match ember.lock")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from ember.manifest import Manifest

    schema = Manifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "ember.toml"
    print(json.dumps(schema, indent=2))
    return 0
