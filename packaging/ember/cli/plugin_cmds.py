"""`ember plugins` and `ember explain`: what is installed, and what would run a package."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

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
                          "kernel_ops": host.kernel_ops.describe(), "problems": problems,
                          "quantization_state": stored[1] if (stored := _stored_for(args.dir, manifest, reports))
                          else None}, indent=2))
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
    quantization = reports.get("quantization")
    if quantization is not None and quantization.name != "none":
        print_quantization_plans(args.dir, manifest.model.weights, quantization)
    ops = Table(title="kernel ops (first that takes the inputs runs)")
    for column in ("op", "tried in order"):
        ops.add_column(column)
    for op, order in host.kernel_ops.describe().items():
        ops.add_row(op, order)
    console.print(ops)
    return 0


def _stored_for(package_dir: Path, manifest: Any, reports: dict) -> tuple[Path, dict] | None:
    quantization = reports.get("quantization")
    if quantization is None or quantization.name == "none":
        return None
    return stored_quantization_state(package_dir, manifest.model.weights, quantization)


def stored_quantization_state(package_dir: Path, weights: str, selection: Any) -> tuple[Path, dict] | None:
    """The newest `quantization.json` beside the engine's quantized-weight cache for this package's weights and
    quantization selection (what the techniques decided when the weights were quantized), or None. Read without
    torch: the engine writes the weights directory and the selection into it (engine/quantized_cache.py)."""
    value = os.environ.get("EMBER_QUANTIZED_CACHE", "")
    if value.lower() in ("off", "0", "false", "none"):
        return None
    root = Path(value) if value else Path.home() / ".cache" / "ember" / "quantized"
    weights_dir = str((package_dir / weights).resolve())
    found = []
    for path in root.glob("*/quantization.json"):
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if (isinstance(state, dict) and state.get("weights_dir") == weights_dir
                and state.get("selection") == selection.name and state.get("options") == dict(selection.options)):
            found.append((path.stat().st_mtime, path, state))
    if not found:
        return None
    _, path, state = max(found, key=lambda f: f[0])
    return path, state


def print_quantization_plans(package_dir: Path, weights: str, selection: Any) -> None:
    """Per technique that plans while quantizing (mixed precision): its stored plan, layer by layer; or where
    and when it will be made."""
    stored = stored_quantization_state(package_dir, weights, selection)
    if stored is None:
        console.print(f"quantization {selection.name}: no stored plan for these weights (a technique that plans "
                      "while quantizing, such as mixed, stores its plan beside the quantized-weight cache on the "
                      "first load; run the model once, then explain again)")
        return
    path, state = stored
    for name, plan in state.get("techniques", {}).items():
        layers = plan.get("layers") if isinstance(plan, dict) else None
        if not isinstance(layers, dict):  # a decision without layers (rotation's seed, chosen or given)
            console.print(f"quantization '{name}' ({path}): {json.dumps(plan, sort_keys=True)}", markup=False)
            continue
        # Plans made before the choice was by calibration loss have only plan_kl.
        scores = "".join(f", {label} {plan[key]}" for key, label in (("plan_loss_increase", "calibration loss "
                                                                      "increase"), ("plan_kl", "calibration KL"))
                         if key in plan)
        chosen = f"; the {plan['plan']} plan{scores}" if plan.get("plan") else ""
        title = (f"quantization plan of '{name}' ({path}): {plan.get('achieved_bits')} bits per weight on average "
                 f"(budget {plan.get('average_bits')}{chosen})")
        table = Table(title=title, caption=str(plan.get("rule", "")))
        for column in ("layer", "precision", "bits", "sensitivity (KL)", "loss increase", "input max/mean",
                       "kurtosis"):
            table.add_column(column)
        for layer, entry in layers.items():
            sens, loss = entry.get("sensitivity", {}), entry.get("loss_increase", {})
            table.add_row(layer, str(entry.get("precision")), str(entry.get("bits")),
                          ", ".join(f"{k} {v:.2e}" for k, v in sens.items() if k != "dense"),
                          ", ".join(f"{k} {v:.2e}" for k, v in loss.items() if k != "dense") or "-",
                          str(entry.get("input_outlier_ratio")), str(entry.get("input_kurtosis")))
        console.print(table)
