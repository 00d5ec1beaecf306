"""n choices of one prompt: siblings sharing the first one's prefill vs n independent requests.

    python bench/bench_n_choices.py [--model examples/tiny-llama] [--quick] [--repeats 3] [--n 8]

Each run takes a fresh --prompt-len token prompt (nothing of it cached) and generates --n sampled choices of
--max-tokens tokens, all submitted at once. "shared": choices 1.. name choice 0 as their prefill leader
(`add_request(share_prefill_with=...)`, what the replica does for `n`): they wait for its prefill and read the prompt's
whole blocks from the prefix cache. "independent": the same n requests without a leader, as n separate API requests
arriving together would be (they are scheduled in one step, before any of them has cached the prompt). Reported: wall
time until every choice is done, time to the last first token, and prompt tokens computed (the engine's prefix-cache
counters). Ratio: independent over shared, median wall time.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from typing import Any

from common import emit, environment, interleaved, median, parse_args, print_table, random_code_tokens, spread

_ids = itertools.count()


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=8, help="choices per prompt (default 8)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 1024; quick 256)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per choice (default 32; quick 8)")


def run(engine: Any, prompt: list[int], n: int, max_tokens: int, shared: bool) -> dict[str, float]:
    from ember_platform import SamplingParams

    stats = engine.stats()
    ids = [f"bench-n-{next(_ids)}" for _ in range(n)]
    first_token: dict[str, float] = {}
    t0 = time.perf_counter()
    for j, request_id in enumerate(ids):
        params = SamplingParams(temperature=1.0, seed=j, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(request_id, prompt, params, share_prefill_with=ids[0] if shared and j else None)
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                first_token.setdefault(out.request_id, time.perf_counter() - t0)
            if out.finished:
                engine.forget(out.request_id)
    wall = time.perf_counter() - t0
    after = engine.stats()
    queried = after["prefix_cache_queried_tokens"] - stats["prefix_cache_queried_tokens"]
    hit = after["prefix_cache_hit_tokens"] - stats["prefix_cache_hit_tokens"]
    return {"wall": wall, "last_ttft": max(first_token.values()), "computed": queried - hit}


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra=add_flags)
    from ember_platform import LLM

    prompt_len = args.prompt_len or (256 if args.quick else 1024)
    max_tokens = args.max_tokens or (8 if args.quick else 32)
    engine = LLM(args.model, enable_prefix_caching=True).engine
    rng = random.Random(11)
    run(engine, random_code_tokens(engine.tokenizer, prompt_len, rng), args.n, 2, True)  # warm-up

    results = interleaved({
        side: (lambda shared=shared: run(engine, random_code_tokens(engine.tokenizer, prompt_len, rng), args.n,
                                         max_tokens, shared))
        for side, shared in (("shared", True), ("independent", False))
    }, args.repeats)
    wall = {side: [r["wall"] for r in runs] for side, runs in results.items()}
    ratio = median(wall["independent"]) / median(wall["shared"])
    computed = {side: median(r["computed"] for r in runs) for side, runs in results.items()}
    print(f"model {args.model}, {args.threads} threads; prompt {prompt_len} tokens, n={args.n} sampled choices of "
          f"{max_tokens} tokens, KV blocks of {engine.block_size} tokens\n")
    print_table(["side", "wall ms: median [min..max]", "last first token ms", "prompt tokens computed"],
                [[side, spread([w * 1e3 for w in wall[side]]),
                  spread([r["last_ttft"] * 1e3 for r in results[side]]), int(computed[side])]
                 for side in results])
    print(f"\nratio independent/shared (wall): {ratio:.2f}x; prompt tokens computed "
          f"{computed['independent'] / computed['shared']:.2f}x fewer when shared")
    emit("n_choices", {
        "ratio": round(ratio, 3), "n": args.n, "prompt_len": prompt_len, "max_tokens": max_tokens,
        "wall_ms": {side: [round(w * 1e3, 2) for w in values] for side, values in wall.items()},
        "last_ttft_ms": {side: [round(r["last_ttft"] * 1e3, 2) for r in runs] for side, runs in results.items()},
        "prompt_tokens_computed": computed, **environment(args),
    }, args.results)


if __name__ == "__main__":
    main()
