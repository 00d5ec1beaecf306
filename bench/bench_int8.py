"""Weight-only int8: batch-1 decode tokens/s with `quantization="int8"` vs without, both `dtype="bfloat16"`.

    python bench/bench_int8.py [--model bench/models/llama-150m] [--quick] [--repeats 3] [--profile]

Batch-1 decode reads every weight once per token, so it is bound by memory bandwidth and int8 halves the
bytes read. The prompt is --prompt-len tokens of standard-library code; greedy decoding of --max-tokens
tokens, EOS ignored; the rate is taken after the first token (prefill is not in it). Ratio: median int8
rate over median bf16 rate. Made for the larger model (`python bench/make_large_model.py`): the example
model is so small that per-step overhead, not weights, sets its decode speed.
"""

from __future__ import annotations

import argparse
from typing import Any

from common import (
    LARGE_MODEL,
    brief_hotspots,
    code_tokens,
    decode_rate,
    emit,
    environment,
    greedy,
    interleaved,
    median,
    parse_args,
    print_hotspots,
    print_table,
    profile_hotspots,
    run_engine,
    spread,
)

TARGET = 1.5


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default 128, --quick 16)")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype of both sides (default bfloat16)")
    parser.add_argument("--kernel", default="auto", help="int8 kernel: auto, fbgemm or int8pack (default auto)")
    parser.add_argument("--dense-threshold", type=int, default=None,
                        help="rows above which int8 uses dequantized dense weights (default: the plugin's)")


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], default_model=LARGE_MODEL, extra=add_flags)
    from ember_platform import LLM

    max_tokens = args.max_tokens or (16 if args.quick else 128)
    base = LLM(args.model, dtype=args.dtype).engine
    options: dict[str, Any] = {"kernel": args.kernel}
    if args.dense_threshold is not None:
        options["dense_threshold"] = args.dense_threshold
    int8 = LLM(args.model, dtype=args.dtype, quantization="int8", quantization_options=options).engine
    kernel = next((m.kernel for m in int8.model.modules() if hasattr(m, "kernel")), "?")
    prompt = code_tokens(base.tokenizer, args.prompt_len)
    for engine in (base, int8):
        run_engine(engine, [prompt], greedy(4))  # warm-up

    runs = interleaved({"int8": lambda: decode_rate(int8, prompt, max_tokens),
                        args.dtype: lambda: decode_rate(base, prompt, max_tokens)}, args.repeats)
    ratio = median(runs["int8"]) / median(runs[args.dtype])
    base_ids = run_engine(base, [prompt], greedy(32))[0].token_ids
    int8_ids = run_engine(int8, [prompt], greedy(32))[0].token_ids
    agree = next((i for i, (a, b) in enumerate(zip(base_ids, int8_ids, strict=True)) if a != b), len(base_ids))
    quant_s = int8.timings.get("quantize", float("nan"))

    print(f"model {args.model}, {args.threads} threads, batch 1; prompt {args.prompt_len} tokens, "
          f"{max_tokens} greedy tokens; {args.repeats} interleaved repeats\n")
    print_table(["weights", "decode tok/s: median [min..max]"],
                [[f"int8 (per-channel, {kernel} kernel)", spread(runs["int8"])],
                 [args.dtype, spread(runs[args.dtype])]])
    print(f"\nratio int8/{args.dtype}: {ratio:.2f}x; target >= {TARGET}x: {'met' if ratio >= TARGET else 'MISSED'}")
    print(f"greedy outputs agree for the first {agree} of 32 tokens; quantizing took {quant_s:.1f} s")

    record: dict[str, Any] = {
        "ratio": round(ratio, 3), "target": TARGET, "int8_tok_s": round(median(runs["int8"]), 2),
        "base_tok_s": round(median(runs[args.dtype]), 2), "int8_runs": [round(r, 2) for r in runs["int8"]],
        "base_runs": [round(r, 2) for r in runs[args.dtype]], "dtype": args.dtype, "prompt_len": args.prompt_len,
        "max_tokens": max_tokens, "kernel": kernel, "greedy_agree_tokens": agree, "quantize_s": round(quant_s, 2),
        **environment(args),
    }
    if args.profile:
        for name, engine in (("int8", int8), (args.dtype, base)):
            hot = profile_hotspots(lambda e=engine: run_engine(e, [prompt], greedy(16)))
            print_hotspots(f"{name}, 16 tokens", hot)
            record[f"hotspots_{name}"] = brief_hotspots(hot)
            record[f"phases_pct_{name}"] = hot["phases_pct"]
    name = args.model.resolve().name
    emit("int8" if name == LARGE_MODEL.name else f"int8-{name}", record, args.results)


if __name__ == "__main__":
    main()
