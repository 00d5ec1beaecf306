"""N-gram speculation (prompt lookup): batch-1 decode tokens/s on code continuation, with and without.

    python bench/bench_ngram.py [--model examples/tiny-llama] [--quick] [--repeats 3] [--profile]

The prompt is real Python (the start of a standard-library module's source, via `inspect.getsource`,
tokenized with the model's tokenizer); greedy decoding of --max-tokens tokens, EOS ignored. Decode rate
is (tokens - 1) / (time from the first token to the last), so prefill is not in it. Ratio: median
rate with `speculator="ngram"` over median rate without. The acceptance rate is the engine's accepted
over proposed draft tokens. How much the speculator helps depends on the model repeating its context:
random weights rarely do, a trained model continuing code often does; the script works with any model.
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


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default="json.decoder", help="stdlib module whose source is the prompt")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512, --quick 256)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default 256, --quick 64)")
    parser.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the manifest's)")
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
    plain = LLM(args.model, **common_overrides).engine
    spec = LLM(args.model, **common_overrides, **spec_overrides).engine
    source = inspect.getsource(importlib.import_module(args.source))
    prompt = plain.tokenizer.encode(source)[:prompt_len]
    if len(prompt) < prompt_len:
        raise SystemExit(f"--source {args.source}: only {len(prompt)} tokens, need --prompt-len {prompt_len}")
    params = greedy(max_tokens)
    for engine in (plain, spec):
        run_engine(engine, [prompt], greedy(8))  # warm-up (and the prompt's KV, cached alike for both)

    def measure(engine: Any) -> tuple[float, Any, int, int]:
        drafts, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
        timing = run_engine(engine, [prompt], params)[0]
        return timing.decode_rate, timing, engine.num_draft_tokens - drafts, engine.num_accepted_tokens - accepted

    runs = interleaved({"ngram": lambda: measure(spec), "none": lambda: measure(plain)}, args.repeats)
    spec_rates = [r[0] for r in runs["ngram"]]
    plain_rates = [r[0] for r in runs["none"]]
    ratio = median(spec_rates) / median(plain_rates)
    drafts = sum(r[2] for r in runs["ngram"])
    accepted = sum(r[3] for r in runs["ngram"])
    acceptance = accepted / drafts if drafts else 0.0
    spec_timing = runs["ngram"][0][1]
    tokens_per_step = spec_timing.num_tokens / spec_timing.num_steps
    same = spec_timing.token_ids == runs["none"][0][1].token_ids
    k = spec.manifest.speculator.num_speculative_tokens

    print(f"model {args.model} ({str(plain.dtype).removeprefix('torch.')}), {args.threads} threads, batch 1; "
          f"prompt: {prompt_len} tokens of `{args.source}` source; {max_tokens} greedy tokens; k = {k}")
    print(f"{args.repeats} interleaved repeats\n")
    print_table(["speculator", "decode tok/s: median [min..max]"],
                [["ngram", spread(spec_rates)], ["none", spread(plain_rates)]])
    print(f"\nratio ngram/none: {ratio:.2f}x; target >= {TARGET}x: {'met' if ratio >= TARGET else 'MISSED'}")
    print(f"acceptance: {accepted}/{drafts} draft tokens = {100 * acceptance:.1f}%; "
          f"{tokens_per_step:.2f} tokens per step; greedy outputs identical with and without: {same}")
    print(f"continuation (ngram run): {plain.tokenizer.decode(spec_timing.token_ids)[:160]!r}")

    record: dict[str, Any] = {
        "ratio": round(ratio, 3), "target": TARGET, "ngram_tok_s": round(median(spec_rates), 1),
        "none_tok_s": round(median(plain_rates), 1), "ngram_runs": [round(r, 1) for r in spec_rates],
        "none_runs": [round(r, 1) for r in plain_rates], "acceptance": round(acceptance, 4),
        "draft_tokens": drafts, "accepted_tokens": accepted, "tokens_per_step": round(tokens_per_step, 3),
        "outputs_identical": same, "k": k, "options": args.options or {}, "prompt_len": prompt_len,
        "max_tokens": max_tokens, "source": args.source, "dtype": str(plain.dtype).removeprefix("torch."),
        **environment(args),
    }
    if args.profile:
        for name, engine in (("ngram", spec), ("none", plain)):
            hot = profile_hotspots(lambda e=engine: run_engine(e, [prompt], greedy(min(64, max_tokens))))
            print_hotspots(f"speculator {name}, {min(64, max_tokens)} tokens", hot)
            record[f"hotspots_{name}"] = brief_hotspots(hot)
            record[f"phases_pct_{name}"] = hot["phases_pct"]
    name = args.model.resolve().name
    suffix = "" if name == "tiny-llama" else f"-{name}"
    suffix += f"-{args.dtype}" if args.dtype else ""
    emit(f"ngram{suffix}", record, args.results)


if __name__ == "__main__":
    main()
