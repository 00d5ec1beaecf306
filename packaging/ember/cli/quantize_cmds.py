"""`ember quantize`: quantize a package's weights once and ship them in it (the platform does the work)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ember.cli.output import console, err_console
from ember.cli.serve_cmds import platform_command


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("quantize", help="quantize a package's weights once and store them in the package",
                       description="Load the package with quantization METHOD (an installed method, or several "
                       "composed: rotation+int4 or '[\"rotation\", \"int4\"]'), calibrating on FILE (default: the "
                       "package's calibration.txt, else the platform's corpus) less its last tenth, held out for a "
                       "quality report (perplexity before/after, greedy agreement over 64 tokens). The quantized "
                       "weights and the report go to DIR/quantized/METHOD/, ember.toml gets [quantization] method "
                       "= METHOD if it had no [quantization] table, and ember.lock is rebuilt: replicas serving the "
                       "package load the quantized weights instead of quantizing at start.")
    p.add_argument("dir", type=Path, metavar="DIR", help="package directory")
    p.add_argument("--method", required=True, metavar="METHOD", help="quantization method(s), e.g. gptq")
    p.add_argument("--calibration", type=Path, metavar="FILE", help="UTF-8 text to calibrate on")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    quantize = platform_command("quantize")
    report = quantize(args.dir, args.method, calibration=args.calibration,
                      say=lambda line: err_console.print(line, markup=False))
    if args.json:
        print(json.dumps(report))
        return 0
    held, greedy = report["held_out"], report["greedy_agreement"]

    def ppl(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    change = held["perplexity_change_pct"]
    console.print(f"{report['method']}: {report['layers']} layers quantized in {report['quantize_seconds']} s",
                  markup=False)
    console.print(f"held-out perplexity ({held['tokens']} tokens): {ppl(held['perplexity_before'])} -> "
                  f"{ppl(held['perplexity_after'])}" + ("" if change is None else f" ({change:+.2f}%)"), markup=False)
    console.print(f"greedy agreement over {greedy['tokens']} tokens ({greedy['prompts']} prompts): "
                  f"{100 * greedy['agreement']:.1f}%", markup=False)
    return 0
