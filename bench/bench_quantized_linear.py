"""Quantized linears vs the dense linear, by rows: the layer shapes of the larger model (qkv, o, gate_up, down of
one decoder layer), each method's layer as the engine builds it, at M = 1..64 rows and prefill chunks of 256-2048.

    python bench/bench_quantized_linear.py [--model bench/models/llama-150m] [--dtype bfloat16] [--rows 1,4,512]

The dense side is the engine's unquantized linear (the kernel-op table's `linear`: the native kernel for a few
float32 rows, else torch's F.linear: oneDNN's bf16 GEMM, on the AMX tile unit where the CPU has one, or MKL's
float32). Each quantized method runs its per-call kernel choice ("auto"); `--paths` also times each of its kernels
forced at every M (native streaming kernel; int8 GEMM on int8 activations; the AMX tile path for int8, int4 and fp8
where the CPU has AMX; fp8's GEMM path: AMX, else bf16-dot tiles for bf16 activations on AVX512_BF16, else tiles
widened into the dense GEMM), which is how the thresholds were picked. gptq runs int4's layers (only its weights
differ), so `int4` stands for both. Ratio: dense time / method time (above 1: the method is faster); the table
quotes the median of --repeats interleaved runs, `--min` the fastest (robust to a loaded machine); `--cpu-time`
(with --threads 1) times by the thread's CPU time, so time spent waiting for a core on a shared machine is left out.
The weights are random (speed does not depend on their values). One JSON line: each method's ratio by rows.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from common import LARGE_MODEL, emit, environment, interleaved, median, parse_args, print_table

ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 512, 1024, 2048)  # decode and batches 1..64, and prefill chunks


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="activations' and dense weights' dtype (default bfloat16, the engine's on this CPU)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts (default %(default)s)")
    parser.add_argument("--methods", default="int8,fp8,int4", help="quantization methods (default %(default)s)")
    parser.add_argument("--paths", action="store_true", help="also time each kernel forced at every row count")
    parser.add_argument("--min", action="store_true", help="quote the fastest run of each side, not the median")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this thread's CPU time (time.thread_time; needs --threads 1): on a loaded "
                             "machine, waiting for a core then does not count")


def layer_shapes(model_dir: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of one decoder layer's fused linears, from config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    return {"qkv_proj": (qkv, hidden), "o_proj": (hidden, config["num_attention_heads"] * head_dim),
            "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}


def builders(dtype: Any) -> dict[str, Callable[[Any], Callable[[Any], Any]]]:
    """name -> (weight -> forward function) for the dense side, each method, and each forced path."""
    from torch import nn

    from ember.plugins import PluginHost
    from ember_platform.api import KernelOps, Linear
    from ember_plugins.quantization.fp8 import Fp8Linear
    from ember_plugins.quantization.int4 import Int4Linear, quantize_rtn
    from ember_plugins.quantization.int8 import Int8Linear

    ops = KernelOps.from_plugins(PluginHost())  # the table an engine builds its model with

    def dense(weight: Any) -> Callable[[Any], Any]:
        layer = Linear(weight.shape[1], weight.shape[0], ops=ops)
        layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        layer.finish_loading()
        return layer

    return {
        "dense": dense,
        "int8": lambda w: Int8Linear(w, None),
        "int8:native": lambda w: Int8Linear(w, None, "native", -1),
        "int8:gemm": lambda w: Int8Linear(w, None, "native", 0, amx_threshold=1 << 30),  # W8A8 int8 GEMM
        "int8:amx": lambda w: Int8Linear(w, None, "native", 0, amx_threshold=0),  # amx_gemm where AMX is
        "fp8": lambda w: Fp8Linear(w, None),
        "fp8:native": lambda w: Fp8Linear(w, None, "native", -1),
        # amx_gemm for bf16 x on AMX, else bf16_gemm on AVX512_BF16, else tiled
        "fp8:gemm": lambda w: Fp8Linear(w, None, "native", 0),
        # gptq runs int4's layers (its weights differ, not its kernel): int4 stands for both here.
        "int4": lambda w: Int4Linear(quantize_rtn(w, 128)),
        "int4:native": lambda w: with_amx_threshold(Int4Linear(quantize_rtn(w, 128)), 1 << 30),
        "int4:amx": lambda w: with_amx_threshold(Int4Linear(quantize_rtn(w, 128)), 0),
    }


def with_amx_threshold(layer: Any, rows: int) -> Any:
    """An int4 layer whose native kernel hands batches above `rows` to the AMX path (where AMX is)."""
    layer.amx_threshold = rows
    return layer


def time_layers(layers: list[Any], x: list[Any], reps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds for one pass over every layer, the mean of `reps` passes."""
    for layer, xi in zip(layers, x, strict=True):
        layer(xi)
    t0 = clock()
    for _ in range(reps):
        for layer, xi in zip(layers, x, strict=True):
            layer(xi)
    return (clock() - t0) / reps


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], default_model=LARGE_MODEL, extra=add_flags)
    import torch

    dtype = getattr(torch, args.dtype)
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time counts the calling thread's CPU time only: run it with --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    rows = [int(r) for r in args.rows.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    shapes = layer_shapes(args.model)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=gen).mul_(0.02) for out, inp in shapes.values()]
    make = builders(dtype)
    sides = ["dense", *methods, *([p for p in make if p.split(":")[0] in methods and ":" in p] if args.paths else [])]
    with torch.inference_mode():
        layers = {side: [make[side](w) for w in weights] for side in sides}
        table, record_rows = [], []
        for m in rows:
            x = [torch.randn(m, w.shape[1], generator=gen).to(dtype) for w in weights]
            reps = max(2, 64 // m) if not args.quick else 2
            runs = interleaved({s: (lambda s=s, x=x, reps=reps: time_layers(layers[s], x, reps, clock)) for s in sides},
                               args.repeats)
            med = {s: (min(v) if args.min else median(v)) for s, v in runs.items()}
            ratios = {s: med["dense"] / med[s] for s in sides if s != "dense"}
            table.append([m, f"{med['dense'] * 1e6:.0f}", *(f"{med[s] * 1e6:.0f} ({ratios[s]:.2f}x)"
                                                            for s in sides[1:])])
            record_rows.append({"rows": m, "dense_us": round(med["dense"] * 1e6, 1),
                                **{f"{s}_ratio": round(r, 3) for s, r in ratios.items()}})
    statistic = ("fastest" if args.min else "median") + (" CPU time" if args.cpu_time else "")
    print(f"model shapes {args.model} ({', '.join(f'{k} {v[0]}x{v[1]}' for k, v in shapes.items())}), "
          f"dtype {args.dtype}, {args.threads} threads, {statistic} of {args.repeats} interleaved runs, "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print_table(["rows", "dense us", *(f"{s} us (dense/it)" for s in sides[1:])], table)
    worst = {s: min(r[f"{s}_ratio"] for r in record_rows) for s in methods}
    print("\nslowest ratio vs dense over the rows: " + ", ".join(f"{s} {v:.2f}x" for s, v in worst.items()))
    emit(f"quantized-linear-{args.dtype}", {"rows": record_rows, "worst": worst, "dtype": args.dtype,
                                            "statistic": statistic,
                                            "shapes": shapes, **environment(args)}, args.results)


if __name__ == "__main__":
    main()
