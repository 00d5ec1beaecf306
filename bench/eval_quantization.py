"""The quantization quality gate: held-out perplexity and greedy agreement over 64 tokens on the example model for
the dense model and every quantization method installed (and their compositions), plus decode tokens/s at batch
1, 8 and 32 on the larger model; one table, each method marked pass/fail against `--threshold`.

    .venv/bin/python bench/eval_quantization.py [--threshold 3] [--windows 24] [--speed/--no-speed] [--only LABEL]

Besides perplexity (the gate) each row has KL: the mean KL divergence per held-out token of its next-token
distribution from the dense model's, the steadier measure of how close a method is (a perplexity change of a few
tenths of a percent on a few thousand tokens can go either way by chance).

Held-out text: the example model's held-out split (whole standard-library files it never trained on, see
examples/make_tiny_llama.py). Calibration text, for the methods that calibrate: training-split files, written as
the calibration.txt of a copy of the package (what `ember quantize --calibration FILE` would use), so the two
never overlap. A method not installed here is listed as such. Every method runs through the engine
(`LLM(..., quantization=...)`), so what is measured is what serves. The "rtn reference" rows, when no `int4`
method is installed, are round-to-nearest int4 weights (gptq_quantize.rtn_quantize) put into a dense model: the
baseline GPTQ must beat at the same group size. Prints the table and a JSON line (bench/results/).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama"
LARGE = ROOT / "bench" / "models" / "llama-150m"
SEQ_LEN = 256
AGREEMENT_TOKENS = 64
CALIBRATION_TOKENS = 64 * 256

# (label, method, options): the rows, in table order; a method not installed is reported, not run.
METHODS: list[tuple[str, Any, dict[str, Any]]] = [
    ("int8", "int8", {}),
    ("int4 g32 (rtn)", "int4", {"group_size": 32}),
    ("int4 g64 (rtn)", "int4", {"group_size": 64}),
    ("int4 g128 (rtn)", "int4", {"group_size": 128}),
    ("gptq int4 g64", "gptq", {"bits": 4, "group_size": 64, "num_samples": 64, "seq_len": 256}),
    ("gptq int4 g128", "gptq", {"bits": 4, "group_size": 128, "num_samples": 64, "seq_len": 256}),
    ("gptq int4 g128 no act-order", "gptq", {"bits": 4, "group_size": 128, "act_order": False, "num_samples": 64,
                                             "seq_len": 256}),
    ("gptq int8", "gptq", {"bits": 8, "group_size": -1, "num_samples": 64, "seq_len": 256}),
    ("fp8", "fp8", {}),
    # rotation's default sites = "calibrated": each rotation kept only where it makes the weights quantize better on
    # calibration text (rotation.calibrate); "all": every rotation QuaRot folds.
    ("rotation+int4 (default: calibrated sites)", ["rotation", "int4"], {}),  # int4's default groups: 128
    ("rotation+int4 g64 (default: calibrated sites)", ["rotation", "int4"],
     {"rotation": {"search_group_size": 64}, "int4": {"group_size": 64}}),
    ("rotation+int4 g128 (all sites)", ["rotation", "int4"], {"rotation": {"sites": "all"}}),
    ("rotation+int4 g64 (all sites)", ["rotation", "int4"],
     {"rotation": {"sites": "all", "search_group_size": 64}, "int4": {"group_size": 64}}),
    ("rotation+int4 (8 seeds)", ["rotation", "int4"], {"rotation": {"candidates": 8}}),
    ("rotation+int4 g64 (8 seeds)", ["rotation", "int4"], {"rotation": {"candidates": 8, "search_group_size": 64},
                                                           "int4": {"group_size": 64}}),
    ("rotation+gptq", ["rotation", "gptq"], {"gptq": {"num_samples": 64, "seq_len": 256}}),
    ("mixed", "mixed", {}),
    # At the bits of a uniform int4 row (4 + 40 / group: a float32 scale and a uint8 zero per group), to compare.
    ("mixed 4.625 bits (= int4 g64)", "mixed", {"average_bits": 4.625}),
    ("mixed 5.25 bits (= int4 g32)", "mixed", {"average_bits": 5.25}),
]
SPEED_BATCHES = (1, 8, 32)
# Decode speed depends on the layers' storage, not on how the weights were chosen: one row per kind of layer, and
# gptq calibrated on little text there (its quality is measured on the example model above).
SPEED_ROWS = {"int8": {}, "int4 g128 (rtn)": {}, "gptq int4 g128": {"num_samples": 8, "seq_len": 256}, "fp8": {},
              "rotation+int4 (default: calibrated sites)": {}, "mixed": {}}


def load_example_script() -> Any:
    spec = importlib.util.spec_from_file_location("make_tiny_llama", ROOT / "examples" / "make_tiny_llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executing
    spec.loader.exec_module(module)
    return module


def held_out_loss(model: torch.nn.Module, windows: torch.Tensor,
                  reference: list[torch.Tensor] | None = None) -> tuple[float, float | None, list[torch.Tensor]]:
    """(mean next-token cross-entropy in nats, mean KL(reference || model) per token or None, the model's
    log-probabilities per window in bfloat16) over the windows, one prefill each. The KL from the dense model is
    the less noisy measure: a quantization's perplexity change on a few thousand tokens is partly chance."""
    from ember_platform.engine.calibration import run_prefill

    total, kl, count, kept = 0.0, 0.0, 0, []
    with torch.inference_mode():
        for i, window in enumerate(windows):
            logits = model.compute_logits(run_prefill(model, window[:-1].tolist())).float()
            total += float(F.cross_entropy(logits, window[1:], reduction="sum"))
            count += len(window) - 1
            log_probs = torch.log_softmax(logits, dim=-1)
            if reference is not None:
                kl += float(F.kl_div(log_probs, reference[i].float(), log_target=True, reduction="sum"))
            else:
                kept.append(log_probs.to(torch.bfloat16))
    return total / count, None if reference is None else kl / count, kept


def package_copy(tmp: Path, calibration: str) -> Path:
    """The example package with a calibration.txt (weights hardlinked: 20 MB not copied)."""
    package = tmp / "tiny-llama"
    shutil.copytree(EXAMPLE, package, copy_function=os.link)
    (package / "calibration.txt").write_text(calibration, encoding="utf-8")
    return package


def installed_methods() -> set[str]:
    from ember.plugins import PluginHost

    return set(PluginHost().techniques.of_kind("quantization"))


def names(method: Any) -> list[str]:
    return [method] if isinstance(method, str) else list(method)


def agreement(reference: list[list[int]], got: list[list[int]]) -> float:
    pairs = list(zip(reference, got, strict=True))
    return sum(sum(a == b for a, b in zip(x, y, strict=True)) for x, y in pairs) / sum(len(x) for x, _ in pairs)


def rtn_reference(package: Path, group_size: int, windows: torch.Tensor, prompts: list[list[int]],
                  params: Any) -> tuple[float, list[list[int]]]:
    """Round-to-nearest int4 (symmetric, as gptq's default) written into a dense model's linears."""
    from ember_platform import LLM
    from ember_platform.engine.linear_method import linear_modules
    from ember_plugins.quantization.gptq_quantize import rtn_quantize

    llm = LLM(package)
    for name, layer in linear_modules(llm.engine.model):
        if name != "lm_head":
            w = layer.weight.data
            w.copy_(rtn_quantize(w, 4, group_size, True).dequantize(w.dtype))
    return held_out_loss(llm.engine.model, windows)[0], [o.token_ids for o in llm.generate(prompts, params)]


def decode_speed(path: Path, method: Any, options: dict[str, Any], calibration: str) -> dict[int, float]:
    """Generated tokens/s at each batch size (16-token prompts, 32 tokens each, one timed run after a warm-up)."""
    from ember_platform import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(path, Path(tmp) / "m", copy_function=os.link)
        (Path(tmp) / "m" / "calibration.txt").write_text(calibration, encoding="utf-8")
        llm = LLM(Path(tmp) / "m", quantization=method, quantization_options=options, max_num_seqs=max(SPEED_BATCHES))
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        speeds = {}
        for batch in SPEED_BATCHES:
            prompts = [[5 + (7 * i + j) % 4000 for j in range(16)] for i in range(batch)]
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            speeds[batch] = round(batch * 32 / (time.perf_counter() - t0), 1)
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threshold", type=float, default=3.0, help="percent perplexity above dense that fails "
                        "the gate (default 3)")
    parser.add_argument("--windows", type=int, default=24, help=f"held-out windows of {SEQ_LEN} tokens (0: all)")
    parser.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                        help=f"decode tokens/s on the larger model ({LARGE}, made by bench/make_large_model.py)")
    parser.add_argument("--quality", action=argparse.BooleanOptionalAction, default=True,
                        help="perplexity and agreement on the example model (--no-quality: the speed table only)")
    parser.add_argument("--only", action="append", default=[], metavar="LABEL",
                        help="run only the rows whose label contains LABEL (repeatable; default: every row)")
    args = parser.parse_args()
    # 2 threads unless OMP_NUM_THREADS says otherwise: on a CPU shared with other jobs, 2 spinning OpenMP threads
    # can run many times slower than 1 (a mixed calibration took over 30 minutes instead of about 4).
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 2))
    from tokenizers import Tokenizer

    from ember_platform import LLM, SamplingParams

    script = load_example_script()
    tokenizer = Tokenizer.from_file(str(EXAMPLE / "weights" / "tokenizer.json"))
    train_files, held_out_files = script.training_files()
    windows = script.windows(script.encode_files(tokenizer, held_out_files), SEQ_LEN)
    if args.windows:
        windows = windows[: args.windows]
    calibration_parts, num_tokens = [], 0
    for path in train_files[:: max(1, len(train_files) // 64)]:  # files from across the training split
        text = path.read_text(encoding="utf-8", errors="replace")
        calibration_parts.append(text)
        num_tokens += len(tokenizer.encode(text).ids)
        if num_tokens >= CALIBRATION_TOKENS:
            break
    calibration = "\n\n".join(calibration_parts)
    prompts = [w[:32].tolist() for w in windows[:: max(1, len(windows) // 8)][:8]]
    params = SamplingParams(temperature=0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    installed = installed_methods()
    os.environ.setdefault("EMBER_QUANTIZED_CACHE", "off")  # measure quantizing, not a cache hit

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.quality:
            windows = windows[:1]  # the dense reference row only, then straight to speed
        package = package_copy(Path(tmp), calibration)
        dense = LLM(package)
        dense_loss, _, dense_log_probs = held_out_loss(dense.engine.model, windows)
        reference = [o.token_ids for o in dense.generate(prompts, params)]
        del dense
        rows.append({"method": "dense (float32)", "ppl": math.exp(dense_loss), "agreement": 1.0, "kl": 0.0,
                     "status": "ok"})
        for label, method, options in METHODS if args.quality else []:
            if args.only and not any(o in label for o in args.only):
                continue
            missing = [n for n in names(method) if n not in installed]
            if missing:
                rows.append({"method": label, "status": f"not installed ({', '.join(missing)})"})
                continue
            t0 = time.perf_counter()
            try:
                llm = LLM(package, quantization=method, quantization_options=options)
            except (ValueError, RuntimeError) as e:
                rows.append({"method": label, "status": f"error: {e}"})
                continue
            load_s = time.perf_counter() - t0
            loss, kl, _ = held_out_loss(llm.engine.model, windows, dense_log_probs)
            got = [o.token_ids for o in llm.generate(prompts, params)]
            rows.append({"method": label, "ppl": math.exp(loss), "agreement": agreement(reference, got),
                         "kl": kl, "load_s": round(load_s, 2), "status": "ok"})
            del llm
        if "int4" not in installed and args.quality:
            for group in (64, 128):
                loss, got = rtn_reference(package, group, windows, prompts, params)
                rows.append({"method": f"rtn int4 g{group} (reference)", "ppl": math.exp(loss),
                             "agreement": agreement(reference, got), "status": "ok"})

    dense_ppl = rows[0]["ppl"]
    for row in rows:
        if "ppl" in row:
            row["ppl_vs_dense_pct"] = round(100 * (row["ppl"] / dense_ppl - 1), 2)
            row["gate"] = "pass" if row["ppl_vs_dense_pct"] <= args.threshold else "FAIL"
            row["ppl"] = round(row["ppl"], 4)
            row["agreement"] = round(row["agreement"], 3)
            if row.get("kl") is not None:
                row["kl"] = round(row["kl"], 6)

    speed: dict[str, Any] = {}
    if args.speed:
        if not (LARGE / "config.json").is_file():
            speed["skipped"] = f"no {LARGE}: run bench/make_large_model.py"
        else:
            speed["dense"] = decode_speed(LARGE, "none", {}, calibration)
            for label, method, options in METHODS:
                if label in SPEED_ROWS and all(n in installed for n in names(method)):
                    options = {**options, **SPEED_ROWS[label]}
                    try:
                        speed[label] = decode_speed(LARGE, method, options, calibration)
                    except (ValueError, RuntimeError) as e:
                        speed[label] = f"error: {e}"
    for row in rows:
        row["tokens_per_s"] = speed.get(row["method"].removesuffix(" (float32)"))

    print(f"held-out: {len(windows)} windows x {SEQ_LEN} tokens; greedy agreement: {len(prompts)} prompts x "
          f"{AGREEMENT_TOKENS} tokens; gate: ppl <= dense + {args.threshold}%; decode tok/s at batch "
          f"{'/'.join(map(str, SPEED_BATCHES))} on {LARGE.name} (loaded shared CPU: indicative)")
    print(f"{'method':46} {'ppl':>9} {'vs dense':>9} {'KL':>9} {'agree':>6} {'gate':>5}  {'tok/s':>20}  status")
    for row in rows:
        ppl = f"{row['ppl']:9.4f}" if "ppl" in row else f"{'-':>9}"
        kl = f"{row['kl']:9.6f}" if row.get("kl") is not None else f"{'-':>9}"
        vs = f"{row['ppl_vs_dense_pct']:+8.2f}%" if "ppl" in row else f"{'-':>9}"
        agree = f"{row['agreement']:6.3f}" if "ppl" in row else f"{'-':>6}"
        tps = row["tokens_per_s"]
        tps_text = "/".join(str(v) for v in tps.values()) if isinstance(tps, dict) else str(tps or "-")
        print(f"{row['method']:46} {ppl} {vs} {kl} {agree} {row.get('gate', '-'):>5}  {tps_text:>20}  {row['status']}")
    dense_speed = speed.get("dense")
    if isinstance(dense_speed, dict):
        print(f"decode tokens/s on {LARGE.name} at batch {', '.join(map(str, SPEED_BATCHES))} (x dense):")
        for label, tps in speed.items():
            ratios = (" ".join(f"{tps[b]:8.1f} ({tps[b] / dense_speed[b]:.2f}x)" for b in SPEED_BATCHES)
                      if isinstance(tps, dict) else str(tps))
            print(f"  {label:46} {ratios}")
    record = {"bench": "eval_quantization", "threshold_pct": args.threshold, "windows": len(windows),
              "dense_ppl": round(dense_ppl, 4), "rows": rows, "speed": speed}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval_quantization.json").write_text(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
