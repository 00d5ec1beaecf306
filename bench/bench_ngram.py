"""N-gram speculation (prompt lookup): batch-1 decode tokens/s on code continuation, with and without.

    python bench/bench_ngram.py [--model examples/tiny-llama] [--quick] [--repeats 3] [--profile]

Each prompt is real Python: the start of a standard-library module's source (via `inspect.getsource`,
tokenized with the model's tokenizer), one prompt per module in --sources, run one at a time (batch 1);
greedy decoding of --max-tokens tokens, EOS ignored. A repeat's decode rate is the tokens after each
request's first, summed over the prompts, over the time from each request's first token to its last,
summed: prefill is not in it. Ratio: median rate with `speculator="ngram"` over median rate without.
The acceptance rate is the engine's accepted over proposed draft tokens. How much the speculator
helps depends on the model repeating its context: random weights rarely do, a trained model continuing
code often does, and by how much differs a lot between files (1.3-4.4 tokens per step on the example
model). So the default is a dozen modules, fixed, and the per-module figures are printed too.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from typing import Any

from common import (
    brief_hotspots,
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
# Common standard-library modules of different kinds (parsers, text utilities, algorithms), in no
# particular order; json.decoder was the single prompt of earlier versions of this bench.
SOURCES = ("json.decoder", "textwrap", "string", "argparse", "csv", "difflib", "heapq", "bisect", "shlex",
           "fnmatch", "glob", "copy")
QUICK_SOURCES = ("json.decoder", "textwrap", "heapq")


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sources", default=",".join(SOURCES),
                        help="stdlib modules whose sources are the prompts, comma-separated (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512, --quick 256)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default 256, --quick 64)")
    parser.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the manifest's)")
    parser.add_argument("--fixed-length", action="store_true",
                        help="draft num_speculative_tokens every step (speculator_adaptive=false) instead of the "
                        "length chosen from measured acceptance and step cost")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: the engine's choice)")
    parser.add_argument("--options", type=json.loads, default=None,
                        help='speculator options as JSON, e.g. \'{"adaptive": false, "min_ngram": 1}\'')


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra=add_flags)
    from ember_platform import LLM

    prompt_len = args.prompt_len or (256 if args.quick else 512)
    max_tokens = args.max_tokens or (64 if args.quick else 256)
    common_overrides: dict[str, Any] = {"dtype": args.dtype} if args.dtype else {}
    spec_overrides: dict[str, Any] = {"speculator": "ngram"}
    if args.k:
        spec_overrides["num_speculative_tokens"] = args.k
    if args.options:
        spec_overrides["speculator_options"] = args.options
    if args.fixed_length:
        spec_overrides["speculator_adaptive"] = False
    plain = LLM(args.model, **common_overrides).engine
    spec = LLM(args.model, **common_overrides, **spec_overrides).engine
    sources = args.sources.split(",")
    if args.quick and tuple(sources) == SOURCES:
        sources = list(QUICK_SOURCES)
    prompts = {}
    for name in sources:
        prompt = plain.tokenizer.encode(inspect.getsource(importlib.import_module(name)))[:prompt_len]
        if len(prompt) < prompt_len:
            raise SystemExit(f"--sources {name}: only {len(prompt)} tokens, need --prompt-len {prompt_len}")
        prompts[name] = prompt
    params = greedy(max_tokens)
    for engine in (plain, spec):
        for prompt in prompts.values():
            run_engine(engine, [prompt], greedy(8))  # warm-up (and the prompt's KV, cached alike for both)

    def measure(engine: Any) -> tuple[float, dict[str, Any], int, int]:
        """One repeat: every prompt at batch 1; (aggregate decode rate, timing per source, drafts, accepted)."""
        drafts, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
        timings = {name: run_engine(engine, [prompt], params)[0] for name, prompt in prompts.items()}
        tokens = sum(t.num_tokens - 1 for t in timings.values())
        seconds = sum(t.total - t.ttft for t in timings.values())
        return tokens / seconds, timings, engine.num_draft_tokens - drafts, engine.num_accepted_tokens - accepted

    runs = interleaved({"ngram": lambda: measure(spec), "none": lambda: measure(plain)}, args.repeats)
    spec_rates = [r[0] for r in runs["ngram"]]
    plain_rates = [r[0] for r in runs["none"]]
    ratio = median(spec_rates) / median(plain_rates)
    drafts = sum(r[2] for r in runs["ngram"])
    accepted = sum(r[3] for r in runs["ngram"])
    acceptance = accepted / drafts if drafts else 0.0
    per_source = {}
    for name in prompts:
        spec_t = [r[1][name] for r in runs["ngram"]]
        plain_t = [r[1][name] for r in runs["none"]]
        per_source[name] = {
            "ratio": round(median([t.decode_rate for t in spec_t]) / median([t.decode_rate for t in plain_t]), 3),
            "tokens_per_step": round(spec_t[0].num_tokens / spec_t[0].num_steps, 3),
            "identical": spec_t[0].token_ids == plain_t[0].token_ids,
        }
    tokens = sum(t.num_tokens for t in runs["ngram"][0][1].values())
    steps = sum(t.num_steps for t in runs["ngram"][0][1].values())
    tokens_per_step = tokens / steps
    same = all(s["identical"] for s in per_source.values())
    k = spec.manifest.speculator.num_speculative_tokens

    print(f"model {args.model} ({str(plain.dtype).removeprefix('torch.')}), {args.threads} threads, batch 1; "
          f"prompts: {prompt_len} tokens of each of {len(prompts)} modules' source; {max_tokens} greedy tokens "
          f"each; k = {k}")
    print(f"{args.repeats} interleaved repeats\n")
    print_table(["speculator", "decode tok/s (all prompts): median [min..max]"],
                [["ngram", spread(spec_rates)], ["none", spread(plain_rates)]])
    print()
    print_table(["source", "ngram/none", "tokens per step", "greedy identical"],
                [[name, f"{s['ratio']:.2f}x", f"{s['tokens_per_step']:.2f}", str(s["identical"])]
                 for name, s in per_source.items()])
    print(f"\nratio ngram/none: {ratio:.2f}x; target >= {TARGET}x: {'met' if ratio >= TARGET else 'MISSED'}")
    print(f"acceptance: {accepted}/{drafts} draft tokens = {100 * acceptance:.1f}%; "
          f"{tokens_per_step:.2f} tokens per step; greedy outputs identical with and without: {same}")

    record: dict[str, Any] = {
        "ratio": round(ratio, 3), "target": TARGET, "ngram_tok_s": round(median(spec_rates), 1),
        "none_tok_s": round(median(plain_rates), 1), "ngram_runs": [round(r, 1) for r in spec_rates],
        "none_runs": [round(r, 1) for r in plain_rates], "acceptance": round(acceptance, 4),
        "draft_tokens": drafts, "accepted_tokens": accepted, "tokens_per_step": round(tokens_per_step, 3),
        "outputs_identical": same, "k": k, "options": args.options or {}, "prompt_len": prompt_len,
        "max_tokens": max_tokens, "sources": per_source, "dtype": str(plain.dtype).removeprefix("torch."),
        **environment(args),
    }
    if args.profile:
        for name, engine in (("ngram", spec), ("none", plain)):
            first = next(iter(prompts.values()))
            hot = profile_hotspots(lambda e=engine, p=first: run_engine(e, [p], greedy(min(64, max_tokens))))
            print_hotspots(f"speculator {name}, {min(64, max_tokens)} tokens", hot)
            record[f"hotspots_{name}"] = brief_hotspots(hot)
            record[f"phases_pct_{name}"] = hot["phases_pct"]
    name = args.model.resolve().name
    suffix = "" if name == "tiny-llama" else f"-{name}"
    suffix += f"-{args.dtype}" if args.dtype else ""
    emit(f"ngram{suffix}", record, args.results)


if __name__ == "__main__":
    main()
