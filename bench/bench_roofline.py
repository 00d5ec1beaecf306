"""Batch-1 decode against the memory-bandwidth roofline: what fraction of the machine's bandwidth a
decode step turns into tokens, for bf16, int8 and float32 weights (--configs picks).

    python bench/bench_roofline.py [--model bench/models/llama-150m] [--quick] [--repeats 3] [--profile]

Bytes per token: every tensor a decode step reads in full (all linear weights and their int8 scales,
lm_head, norms), plus one row of the embedding table (unless it is tied to lm_head). The KV cache read
is left out (it is small at this context length) and printed beside. Bandwidth: measured here, in the same
process with the same threads, as the best of a large tensor's sum (read) and copy (read + write), median
of several. Fraction = decode tok/s x bytes per token / bandwidth. Ratio: the best configuration's fraction.
"""

from __future__ import annotations

import argparse
import time
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

TARGET = 0.40
CONFIGS = {  # name -> engine overrides
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "float32": {"dtype": "float32"},
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default="bfloat16,int8,float32",
                        help=f"comma-separated, of {', '.join(CONFIGS)} (default: all three)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default 128, --quick 16)")
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="test tensor size (default 1024, --quick 256)")


def weight_bytes_per_token(model: Any) -> tuple[int, dict[str, int]]:
    """Bytes one decode step reads from the model's parameters and buffers, and a breakdown by kind."""
    from torch import nn

    embeddings = {id(m.weight) for name, m in model.named_modules()
                  if name.endswith("embed_tokens") or isinstance(m, nn.Embedding)}
    lm_head = getattr(model, "lm_head", None)
    tied = lm_head is not None and id(getattr(lm_head, "weight", None)) in embeddings
    seen: set[int] = set()
    kinds: dict[str, int] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if id(tensor) in embeddings and not tied:
            kind, nbytes = "embedding (one row)", tensor.shape[-1] * tensor.element_size()
        else:
            kind = ("lm_head" if name.startswith("lm_head") else "norms" if "norm" in name
                    else "int8 scales" if name.endswith("scale") else "linear weights")
            nbytes = tensor.numel() * tensor.element_size()
        kinds[kind] = kinds.get(kind, 0) + nbytes
    return sum(kinds.values()), kinds


def kv_bytes_per_token(engine: Any, context_len: int) -> int:
    """K and V of every layer for `context_len` positions: what attention reads at that length."""
    k_cache = engine.executor.kv_caches[0][0]
    per_position = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size() * 2
    return per_position * len(engine.executor.kv_caches) * context_len


def measure_bandwidth(num_bytes: int, trials: int = 7) -> dict[str, float]:
    """GB/s (1e9 bytes) of a fp32 sum (bytes read) and copy (bytes read + written), median of `trials`."""
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    x.sum()
    y.copy_(x)  # first touch: page faults are not bandwidth
    sums, copies = [], []
    for _ in range(trials):
        t0 = time.perf_counter()
        x.sum()
        t1 = time.perf_counter()
        y.copy_(x)
        t2 = time.perf_counter()
        sums.append(num_bytes / (t1 - t0) / 1e9)
        copies.append(2 * num_bytes / (t2 - t1) / 1e9)
    return {"sum": median(sums), "copy": median(copies), "best": max(median(sums), median(copies))}


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], default_model=LARGE_MODEL, extra=add_flags)
    from ember_platform import LLM

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    max_tokens = args.max_tokens or (16 if args.quick else 128)
    size = (args.bandwidth_mib or (256 if args.quick else 1024)) * 2**20
    engines = {name: LLM(args.model, **CONFIGS[name]).engine for name in names}
    prompt = code_tokens(next(iter(engines.values())).tokenizer, args.prompt_len)
    for engine in engines.values():
        run_engine(engine, [prompt], greedy(4))  # warm-up

    sides: dict[str, Any] = {"bandwidth": lambda: measure_bandwidth(size)}
    for name, engine in engines.items():
        sides[name] = lambda e=engine: decode_rate(e, prompt, max_tokens)
    runs = interleaved(sides, args.repeats)
    bandwidth = median(b["best"] for b in runs["bandwidth"])
    mid_context = args.prompt_len + max_tokens // 2

    rows, results = [], {}
    for name, engine in engines.items():
        nbytes, kinds = weight_bytes_per_token(engine.model)
        rate = median(runs[name])
        achieved = rate * nbytes / 1e9
        results[name] = {"tok_s": round(rate, 2), "runs": [round(r, 2) for r in runs[name]],
                         "weight_mb_per_token": round(nbytes / 1e6, 2),
                         "bytes_by_kind": kinds, "achieved_gb_s": round(achieved, 2),
                         "fraction": round(achieved / bandwidth, 3),
                         "roofline_tok_s": round(bandwidth * 1e9 / nbytes, 1)}
        rows.append([name, spread(runs[name]), f"{nbytes / 1e6:.1f}", f"{achieved:.2f}",
                     f"{results[name]['roofline_tok_s']:.1f}", f"{100 * achieved / bandwidth:.0f}%"])
    best = max(results, key=lambda n: results[n]["fraction"])
    fraction = results[best]["fraction"]
    kv_mb = kv_bytes_per_token(next(iter(engines.values())), mid_context) / 1e6

    print(f"model {args.model}, {args.threads} threads, batch 1; prompt {args.prompt_len} tokens, {max_tokens} "
          f"greedy tokens; {args.repeats} interleaved repeats")
    bw = runs["bandwidth"]
    print(f"bandwidth ({size >> 20} MiB fp32): sum {spread([b['sum'] for b in bw])} GB/s, "
          f"copy {spread([b['copy'] for b in bw])} GB/s; roof = {bandwidth:.2f} GB/s\n")
    print_table(["weights", "decode tok/s: median [min..max]", "MB/token", "GB/s", "roof tok/s", "of roof"], rows)
    print(f"\n(KV cache read at the run's middle context, {mid_context} tokens: {kv_mb:.2f} MB/token, not counted)")
    print(f"best: {best} at {100 * fraction:.0f}% of the roofline; target >= {100 * TARGET:.0f}%: "
          f"{'met' if fraction >= TARGET else 'MISSED'}")

    record: dict[str, Any] = {
        "ratio": fraction, "target": TARGET, "best": best, "bandwidth_gb_s": round(bandwidth, 2),
        "bandwidth_runs": [{k: round(v, 2) for k, v in b.items()} for b in bw], "configs": results,
        "kv_mb_per_token_mid": round(kv_mb, 3), "prompt_len": args.prompt_len, "max_tokens": max_tokens,
        **environment(args),
    }
    if args.profile:
        for name, engine in engines.items():
            hot = profile_hotspots(lambda e=engine: run_engine(e, [prompt], greedy(16)))
            print_hotspots(f"{name}, 16 tokens", hot)
            record[f"hotspots_{name}"] = brief_hotspots(hot)
            record[f"phases_pct_{name}"] = hot["phases_pct"]
    name = args.model.resolve().name
    emit("roofline" if name == LARGE_MODEL.name else f"roofline-{name}", record, args.results)


if __name__ == "__main__":
    main()
