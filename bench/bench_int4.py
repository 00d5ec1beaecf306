"""int4 weights: decode tokens/s of `quantization="int4"` vs int8 vs none (all `dtype="bfloat16"`) at batch 1, 8
and 32, and a microbench of one linear layer at M = 1, 4, 16, 64, 512 rows (decode to prefill chunks).

    python bench/bench_int4.py [--model bench/models/llama-150m] [--quick] [--repeats 3] [--group-size 128]
        [--also fp8,gptq]

Batch 1: the rate after the first token of one greedy request (--prompt-len code tokens, --max-tokens tokens,
EOS ignored). Batch 8 / 32: that many requests at once, generated tokens per second of the whole run (their
prefill included, the same for every side). The linear microbench times the model's own layers (layer 0's
gate_up_proj, 1024 -> 5632, and down_proj, 2816 -> 1024), bf16 through the engine's `linear` kernel op as the
unquantized method runs it, int4 through its kernel, on the same bf16 input. Ratios are of medians over
--repeats interleaved runs. Targets (issue 17): batch 1 int4 >= 1.3x int8 and >= 2x bf16; batch 8 and 32 and
every linear row count >= 1.0x bf16. `--also` adds more methods to the decode rows (each >= 1.0x bf16 at the
batches; options as bench_throughput's QUANTIZERS: gptq calibrates on 8 x 256 tokens of the default corpus).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from common import (
    LARGE_MODEL,
    code_tokens,
    decode_rate,
    emit,
    environment,
    greedy,
    interleaved,
    median,
    parse_args,
    print_table,
    run_engine,
    spread,
)

TARGET_VS_INT8, TARGET_VS_BF16, TARGET_BATCHED = 1.3, 2.0, 1.0
LINEAR_ROWS = (1, 4, 16, 64, 512)


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64, --quick 16)")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size (default 128)")
    parser.add_argument("--batches", default="8,32", help="batch sizes besides 1 (default 8,32)")
    parser.add_argument("--also", default="", help="more methods for the decode rows, e.g. fp8,gptq (QUANTIZERS of "
                        "bench_throughput)")


def batch_rate(engine: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Generated tokens per second of the whole batch, prefill included."""
    t0 = time.perf_counter()
    timings = run_engine(engine, prompts, greedy(max_tokens))
    return sum(t.num_tokens for t in timings) / (time.perf_counter() - t0)


def linear_ms(layer: Any, rows: int, repeats: int) -> float:
    """Median ms of layer(x) for a bf16 x of `rows` rows (after one warm-up call)."""
    import torch

    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    times = []
    with torch.inference_mode():
        layer(x)
        for _ in range(max(repeats, 5)):
            t0 = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], default_model=LARGE_MODEL, extra=add_flags)
    from ember_platform import LLM

    max_tokens = args.max_tokens or (16 if args.quick else 64)
    batches = [int(b) for b in args.batches.split(",") if b]
    from bench_throughput import QUANTIZERS

    also = [m for m in args.also.split(",") if m]
    unknown = [m for m in also if m not in QUANTIZERS or m in ("int4", "int8")]
    if unknown:
        raise SystemExit(f"--also {','.join(unknown)}: not one of {', '.join(set(QUANTIZERS) - {'int4', 'int8'})}")
    engines = {
        "int4": LLM(args.model, dtype="bfloat16", quantization="int4",
                    quantization_options={"group_size": args.group_size}).engine,
        "int8": LLM(args.model, dtype="bfloat16", quantization="int8").engine,
        "bf16": LLM(args.model, dtype="bfloat16").engine,
        **{m: LLM(args.model, dtype="bfloat16", quantization=m.split("+") if "+" in m else m,
                  quantization_options=QUANTIZERS[m]).engine for m in also},
    }
    int4_layer = engines["int4"].model.model.layers[0].mlp.gate_up_proj
    kernel = int4_layer.method.describe(int4_layer)
    prompt = code_tokens(engines["bf16"].tokenizer, args.prompt_len)
    for engine in engines.values():
        run_engine(engine, [prompt], greedy(4))  # warm-up

    record: dict[str, Any] = {"int4": kernel, "group_size": args.group_size, "prompt_len": args.prompt_len,
                              "max_tokens": max_tokens}
    rows, verdicts = [], []
    runs = interleaved({name: (lambda e=e: decode_rate(e, prompt, max_tokens)) for name, e in engines.items()},
                       args.repeats)
    b1 = {name: median(r) for name, r in runs.items()}
    vs_int8, vs_bf16 = b1["int4"] / b1["int8"], b1["int4"] / b1["bf16"]
    rows.append(["1", spread(runs["int4"]), spread(runs["int8"]), spread(runs["bf16"]),
                 f"{vs_int8:.2f}x", f"{vs_bf16:.2f}x",
                 *(f"{spread(runs[m])} ({b1[m] / b1['bf16']:.2f}x)" for m in also)])
    verdicts += [("batch 1 int4/int8", vs_int8, TARGET_VS_INT8), ("batch 1 int4/bf16", vs_bf16, TARGET_VS_BF16)]
    record["batch_1"] = {"tok_s": {k: round(v, 2) for k, v in b1.items()}, "int4_vs_int8": round(vs_int8, 3),
                         "int4_vs_bf16": round(vs_bf16, 3), **{f"{m}_vs_bf16": round(b1[m] / b1["bf16"], 3)
                                                                for m in also}}
    for batch in batches:
        prompts = [code_tokens(engines["bf16"].tokenizer, args.prompt_len, offset=97 * i) for i in range(batch)]
        runs = interleaved({name: (lambda e=e, p=prompts: batch_rate(e, p, max_tokens)) for name, e in engines.items()},
                           args.repeats)
        rate = {name: median(r) for name, r in runs.items()}
        ratio8, ratio16 = rate["int4"] / rate["int8"], rate["int4"] / rate["bf16"]
        rows.append([str(batch), spread(runs["int4"]), spread(runs["int8"]), spread(runs["bf16"]),
                     f"{ratio8:.2f}x", f"{ratio16:.2f}x",
                     *(f"{spread(runs[m])} ({rate[m] / rate['bf16']:.2f}x)" for m in also)])
        verdicts += [(f"batch {batch} {m}/bf16", rate[m] / rate["bf16"], TARGET_BATCHED)
                     for m in ("int4", "int8", *also)]
        record[f"batch_{batch}"] = {"tok_s": {k: round(v, 2) for k, v in rate.items()},
                                    "int4_vs_int8": round(ratio8, 3), "int4_vs_bf16": round(ratio16, 3),
                                    **{f"{m}_vs_bf16": round(rate[m] / rate["bf16"], 3) for m in ("int8", *also)}}

    print(f"model {args.model}, {args.threads} threads, bf16 activations; int4: {kernel}; prompts "
          f"{args.prompt_len} tokens, {max_tokens} greedy tokens each; {args.repeats} interleaved repeats\n")
    print_table(["batch", "int4 tok/s", "int8 tok/s", "bf16 tok/s", "int4/int8", "int4/bf16",
                 *(f"{m} tok/s (/bf16)" for m in also)], rows)

    linear_rows = []
    record["linear_ms"] = {}
    for attr in ("gate_up_proj", "down_proj"):
        sides = {name: getattr(e.model.model.layers[0].mlp, attr) for name, e in engines.items()}
        for m in LINEAR_ROWS:
            ms = {name: linear_ms(layer, m, args.repeats) for name, layer in sides.items()}
            ratio = ms["bf16"] / ms["int4"]
            shape = f"{sides['bf16'].in_features}->{sides['bf16'].out_features}"
            linear_rows.append([f"{attr} {shape}", str(m), f"{ms['int4']:.3f}", f"{ms['int8']:.3f}",
                                f"{ms['bf16']:.3f}", f"{ratio:.2f}x"])
            verdicts.append((f"{attr} M={m} bf16/int4 time", ratio, TARGET_BATCHED))
            record["linear_ms"][f"{attr}_M{m}"] = {k: round(v, 4) for k, v in ms.items()}
    print()
    print_table(["linear", "rows", "int4 ms", "int8 ms", "bf16 ms", "speed int4/bf16"], linear_rows)
    print()
    for what, value, target in verdicts:
        print(f"{what}: {value:.2f}x, target >= {target}x: {'met' if value >= target else 'MISSED'}")
    record["missed"] = [what for what, value, target in verdicts if value < target]
    record.update(environment(args))
    name = args.model.resolve().name
    emit("int4" if name == LARGE_MODEL.name else f"int4-{name}", record, args.results)


if __name__ == "__main__":
    main()
