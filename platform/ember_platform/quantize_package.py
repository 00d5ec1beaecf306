"""`ember quantize DIR --method M [--calibration FILE]`: quantize a package's weights once and ship them in it.

The package is loaded through the engine with the quantization (any installed method or composition: "gptq",
"int8", "rotation+int4"), calibrating on FILE, else the package's calibration.txt, else the platform's corpus,
less its last tenth, which is held out for the quality report: perplexity before and after on that text and
greedy agreement over 64 tokens. The quantized weights and the report go to `quantized/<method>/` (see
engine/packaged_quantized.py), ember.toml gets `[quantization] method = M` when it had no [quantization] table,
and the lock is rebuilt, so the new files are content-addressed and verified like the weights. A replica serving
the package then loads them and never quantizes at start.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ember.errors import EmberError
from ember.manifest import MANIFEST_NAME
from ember.manifest.schema import COMPOSE, NONE
from ember.package.build import build_package
from ember.plugins import load_package
from ember_platform.engine.calibration import CALIBRATION_ENV, calibration_text, run_prefill
from ember_platform.engine.linear_method import UNQUANTIZED, linear_modules
from ember_platform.engine.packaged_quantized import remove_entry, write_entry

HELD_OUT_FRACTION = 0.1
EVAL_WINDOW = 256
EVAL_TOKENS = 4096
AGREEMENT_TOKENS = 64
AGREEMENT_PROMPTS = 4
PROMPT_TOKENS = 16


def parse_method(text: str) -> list[str]:
    """"gptq", "rotation+int4" or a JSON list '["rotation", "int4"]' -> the method names, in order."""
    text = text.strip()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except ValueError as e:
            raise EmberError(f"--method {text!r}: not a JSON list of method names ({e})") from None
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise EmberError(f"--method {text!r}: a JSON list of method names, e.g. [\"rotation\", \"int4\"]")
    else:
        names = text.split(COMPOSE)
    if not names or any(not n or n == NONE for n in names):
        raise EmberError(f"--method {text!r}: name a quantization method (`ember plugins` lists them)")
    return names


def split_held_out(text: str) -> tuple[str, str]:
    """(calibration part, held-out part): the held-out part is the last tenth of the lines."""
    lines = text.splitlines(keepends=True)
    cut = len(lines) - max(1, int(len(lines) * HELD_OUT_FRACTION)) if len(lines) > 1 else len(lines)
    return "".join(lines[:cut]), "".join(lines[cut:])


def read_calibration(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EmberError(f"--calibration {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise EmberError(f"--calibration {path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise EmberError(f"--calibration {path}: cannot read it ({e.strerror or e})") from None
    if not text.strip():
        raise EmberError(f"--calibration {path}: the file is empty")
    return text


def perplexity(model: torch.nn.Module, ids: Sequence[int]) -> float | None:
    """exp(mean next-token loss) over `ids` in windows of EVAL_WINDOW tokens; None when there are too few."""
    ids = list(ids)[:EVAL_TOKENS]
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, EVAL_WINDOW):
            window = ids[start:start + EVAL_WINDOW + 1]
            if len(window) < 2:
                break
            logits = model.compute_logits(run_prefill(model, window[:-1]))
            total += float(F.cross_entropy(logits.float(), torch.tensor(window[1:], device=logits.device),
                                           reduction="sum"))
            count += len(window) - 1
    return math.exp(total / count) if count else None


def _engine_greedy(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from ember_platform import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _add_quantization_table(manifest_path: Path, method: list[str]) -> None:
    value = json.dumps(method[0]) if len(method) == 1 else json.dumps(method)
    text = manifest_path.read_text(encoding="utf-8")
    manifest_path.write_text(f"{text.rstrip()}\n\n[quantization]\nmethod = {value}  # ember quantize: the "
                             f"quantized weights are in quantized/{COMPOSE.join(method)}/\n", encoding="utf-8")


def quantize(package_dir: Path, method: str, *, calibration: Path | None = None,
             say: Callable[[str], None] = print) -> dict[str, Any]:
    """Quantize the package in `package_dir` with `method` (see the module docstring); returns the report."""
    from ember_platform import LLM

    root = Path(package_dir)
    if not (root / MANIFEST_NAME).is_file():
        raise EmberError(f"{root}: not a package directory (no {MANIFEST_NAME}); `ember init` makes one")
    manifest, host = load_package(root)
    names = parse_method(method)
    installed = host.techniques.of_kind("quantization")
    for name in names:
        if name not in installed:
            raise EmberError(f"--method {method!r}: no installed plugin provides quantization '{name}' (installed: "
                             f"{', '.join(sorted(installed)) or 'none'})")
    selection = COMPOSE.join(names)
    section = manifest.quantization
    declared = "quantization" in manifest.model_fields_set and section.method != NONE
    if declared and section.method != selection:
        raise EmberError(f"{root / MANIFEST_NAME}: [quantization] method = {section.method!r}, not --method "
                         f"{selection!r}: the package serves its manifest's method, so quantize with that one or "
                         "change the manifest first")
    options = dict(section.options) if declared else {}

    text, source = (read_calibration(calibration), calibration) if calibration is not None else calibration_text(root)
    calibration_part, held_out = split_held_out(text)
    if not calibration_part.strip():
        raise EmberError(f"{source}: too short to hold some text out for the quality report (one line)")
    remove_entry(root, selection)  # quantize afresh, never from what an earlier run wrote
    saved = {k: os.environ.get(k) for k in (CALIBRATION_ENV, "EMBER_QUANTIZED_CACHE")}
    with tempfile.TemporaryDirectory() as tmp:
        calibration_file = Path(tmp) / "calibration.txt"
        calibration_file.write_text(calibration_part, encoding="utf-8")
        os.environ[CALIBRATION_ENV] = str(calibration_file)
        os.environ["EMBER_QUANTIZED_CACHE"] = "off"  # measure and store this run's quantization
        try:
            say(f"quantizing {root} with {selection} (calibration: {source}, {len(calibration_part)} characters)")
            t0 = time.perf_counter()
            try:
                quantized = LLM(root, quantization=names if len(names) > 1 else names[0],
                                quantization_options=options)
            except ValueError as e:  # QuantizationError: a bad option, a composition that cannot work
                raise EmberError(f"{root / MANIFEST_NAME}: quantization {selection!r}: {e}") from None
            quantize_s = time.perf_counter() - t0
            dense = LLM(root, quantization=NONE, quantization_options={})
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    held_ids = dense.tokenizer.encode(held_out, add_special_tokens=False)
    before, after = perplexity(dense.engine.model, held_ids), perplexity(quantized.engine.model, held_ids)
    step = max(PROMPT_TOKENS, len(held_ids) // AGREEMENT_PROMPTS)
    prompts = [held_ids[i:i + PROMPT_TOKENS] for i in range(0, len(held_ids) - PROMPT_TOKENS + 1, step)]
    prompts = prompts[:AGREEMENT_PROMPTS] or [dense.tokenizer.encode("def main(", add_special_tokens=False)]
    reference, got = _engine_greedy(dense, prompts), _engine_greedy(quantized, prompts)
    agree = sum(a == b for r, g in zip(reference, got, strict=True) for a, b in zip(r, g, strict=True))
    report = {
        "calibration": {"source": str(source), "characters": len(calibration_part)},
        "held_out": {"tokens": len(held_ids), "perplexity_before": before, "perplexity_after": after,
                     "perplexity_change_pct": None if not before or after is None else 100 * (after / before - 1)},
        "greedy_agreement": {"prompts": len(prompts), "tokens": AGREEMENT_TOKENS,
                             "agreement": agree / (len(prompts) * AGREEMENT_TOKENS)},
        "quantize_seconds": round(quantize_s, 2),
    }
    model = quantized.engine.model
    layers = {name: layer.method.describe(layer) for name, layer in linear_modules(model)
              if layer.method is not UNQUANTIZED}
    chosen = quantized.engine.selections["quantization"]  # what a replica's lookup compares against
    entry = write_entry(root, quantized.engine.source.weights_dir, chosen.name, chosen.options, quantized.engine.dtype,
                        model, layers, report, quantized.engine.quantization_states)
    del quantized, dense
    if not declared:
        _add_quantization_table(root / MANIFEST_NAME, names)
    lock = build_package(root, host)
    say(f"wrote {entry.relative_to(root)}/ ({len(layers)} quantized layers); {root / 'ember.lock'}: {lock.digest}")
    return {"method": selection, "options": options, "entry": str(entry), "layers": len(layers), **report}
