"""Prefix caching: time to first token for a long shared prefix, cache miss vs cache hit.

    python bench/bench_prefix_ttft.py [--model examples/tiny-llama] [--quick] [--repeats 3] [--profile]

Each repeat takes a fresh --prefix-len token prefix (a window of standard-library code at a new place, so
nothing of it is cached), sends prefix + a new suffix (the miss: the whole prompt is prefilled), then
--hits requests of prefix + another new suffix (hits: only the suffix is computed). TTFT is measured in the
engine's step loop, from `add_request` to the step that returns the first token. Ratio: median miss TTFT
over median hit TTFT.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from common import (
    brief_hotspots,
    emit,
    environment,
    greedy,
    median,
    parse_args,
    print_hotspots,
    print_table,
    profile_hotspots,
    random_code_tokens,
    run_engine,
    spread,
)

TARGET = 5.0


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-len", type=int, default=None, help="shared prefix tokens (default 1024)")
    parser.add_argument("--suffix-len", type=int, default=32, help="new tokens after it (default 32)")
    parser.add_argument("--hits", type=int, default=3, help="hit requests per prefix, each a fresh suffix")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: the engine's choice)")


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra=add_flags)
    from ember_platform import LLM

    prefix_len = args.prefix_len or (256 if args.quick else 1024)
    llm = LLM(args.model, enable_prefix_caching=True, **({"dtype": args.dtype} if args.dtype else {}))
    engine = llm.engine
    tok = engine.tokenizer
    rng = random.Random(7)
    # One token: the request ends in its prefill step, and LLMEngine.step registers its full blocks in the
    # prefix cache before it frees them, so the next request hits them.
    first_token = greedy(1)
    run_engine(engine, [random_code_tokens(tok, prefix_len + args.suffix_len, rng)], first_token)  # warm-up

    misses: list[float] = []
    hits: list[float] = []
    cached: list[int] = []
    for _ in range(args.repeats):
        prefix = random_code_tokens(tok, prefix_len, rng)
        miss = run_engine(engine, [prefix + random_code_tokens(tok, args.suffix_len, rng)], first_token)[0]
        if miss.cached_tokens:
            raise RuntimeError(f"the 'miss' found {miss.cached_tokens} tokens cached: prefixes are not fresh")
        misses.append(miss.ttft)
        for _ in range(args.hits):
            hit = run_engine(engine, [prefix + random_code_tokens(tok, args.suffix_len, rng)], first_token)[0]
            hits.append(hit.ttft)
            cached.append(hit.cached_tokens)

    ratio = median(misses) / median(hits)
    block = engine.block_size
    print(f"model {args.model} ({str(engine.dtype).removeprefix('torch.')}), {args.threads} threads; "
          f"prefix {prefix_len} tokens + suffix {args.suffix_len}, KV blocks of {block} tokens")
    print(f"{args.repeats} fresh prefixes, each: 1 miss then {args.hits} hits (fresh suffixes); "
          f"hits found {min(cached)}..{max(cached)} tokens cached\n")
    print_table(["request", "TTFT ms: median [min..max]"],
                [["miss (whole prompt)", spread([t * 1e3 for t in misses])],
                 ["hit (suffix only)", spread([t * 1e3 for t in hits])]])
    print(f"\nratio miss/hit: {ratio:.2f}x; target >= {TARGET}x: {'met' if ratio >= TARGET else 'MISSED'}")

    record: dict[str, Any] = {
        "ratio": round(ratio, 3), "target": TARGET, "miss_ttft_ms": round(median(misses) * 1e3, 2),
        "hit_ttft_ms": round(median(hits) * 1e3, 2), "misses_ms": [round(t * 1e3, 2) for t in misses],
        "hits_ms": [round(t * 1e3, 2) for t in hits], "prefix_len": prefix_len, "suffix_len": args.suffix_len,
        "cached_tokens": [min(cached), max(cached)], "dtype": str(engine.dtype).removeprefix("torch."),
        **environment(args),
    }
    if args.profile:
        def some_hits() -> None:
            prefix = random_code_tokens(tok, prefix_len, rng)
            run_engine(engine, [prefix + random_code_tokens(tok, args.suffix_len, rng)], first_token)
            for _ in range(5):
                run_engine(engine, [prefix + random_code_tokens(tok, args.suffix_len, rng)], first_token)

        hot = profile_hotspots(some_hits)
        print_hotspots("one miss then 5 hits", hot)
        record["hotspots"] = brief_hotspots(hot)
        record["phases_pct"] = hot["phases_pct"]
    name = args.model.resolve().name
    suffix = "" if name == "tiny-llama" else f"-{name}"
    suffix += f"-{args.dtype}" if args.dtype else ""
    emit(f"prefix_ttft{suffix}", record, args.results)


if __name__ == "__main__":
    main()
