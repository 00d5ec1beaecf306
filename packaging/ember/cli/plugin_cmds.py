"""`ember plugins` and `ember explain`: what is installed, and what would run a package."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from ember.cli.output import console


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list installed plugins and the techniques each registers",
                       description="List plugins found through the 'ember' entry-point group (built-in and "
                       "third-party), their distribution and version, and the techniques they register. "
                       "EMBER_DISABLE_PLUGINS=a,b hides plugins a and b.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("explain", help="show which technique of each kind would run a package, and why",
                       description="Load a package's manifest and hooks.py (not its weights), detect this "
                       "machine's hardware, and print per technique kind what was selected and why: the "
                       "manifest's value, a hook in a plugin or in the package, or an auto rule; then per kernel "
                       "op the implementations an engine tries, in order.")
    p.add_argument("dir", type=Path, metavar="DIR", help="package directory")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_explain)


def cmd_plugins(args: argparse.Namespace) -> int:
    from ember.plugins import PluginHost

    host = PluginHost()
    infos = host.plugins()
    if args.json:
        print(json.dumps([
            {"name": p.name, "source": p.source, "distribution": p.distribution, "version": p.version,
             "techniques": [{"kind": t.kind, "name": t.name, "summary": t.summary} for t in p.techniques]}
            for p in infos
        ], indent=2))
        return 0
    table = Table(title="ember plugins")
    for column in ("plugin", "from", "version", "techniques"):
        table.add_column(column)
    for p in infos:
        techniques = ", ".join(f"{t.kind} [bold]{t.name}[/]" for t in p.techniques) or "—"
        table.add_row(p.name, p.distribution or p.source, p.version or "—", techniques)
    console.print(table)
    if host.disabled:
        console.print(f"disabled by EMBER_DISABLE_PLUGINS: {', '.join(sorted(host.disabled))}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from ember.chat_templates import read_chat_templates, tool_template
    from ember.errors import PluginError
    from ember.plugins import load_package
    from ember.techniques import SELECTABLE

    manifest, host = load_package(args.dir)
    hardware = host.hardware(manifest)
    reports, problems = {}, {}
    for kind in SELECTABLE:
        # Explain reports, it does not gate: a kind with nothing installed is shown, not fatal.
        try:
            reports[kind] = host.select(kind, manifest, hardware)
        except PluginError as e:
            problems[kind] = str(e)
    try:
        template = tool_template(read_chat_templates(args.dir / manifest.model.weights))
        reports["tool_parser"] = host.select_tool_parser(manifest, template)
    except (PluginError, ValueError) as e:
        problems["tool_parser"] = str(e)
    if args.json:
        print(json.dumps({"package": manifest.reference, "hardware": hardware.describe(),
                          "selections": {k: r.as_dict() for k, r in reports.items()},
                          "kernel_ops": host.kernel_ops.describe(), "problems": problems}, indent=2))
        return 0
    console.print(f"[bold]{manifest.reference}[/] on {hardware.describe()}")
    table = Table()
    for column in ("technique", "selected", "options", "decided by", "why"):
        table.add_column(column)
    for kind, r in reports.items():
        options = ", ".join(f"{k}={v}" for k, v in r.options.items()) or "—"
        table.add_row(kind, f"[bold]{r.name}[/]", options, r.decided_by, r.reason or "—")
    for kind, problem in problems.items():
        table.add_row(kind, "[red]none[/]", "—", "—", f"[red]{problem}[/]")
    console.print(table)
    ops = Table(title="kernel ops (first that takes the inputs runs)")
    for column in ("op", "tried in order"):
        ops.add_column(column)
    for op, order in host.kernel_ops.describe().items():
        ops.add_row(op, order)
    console.print(ops)
    return 0
