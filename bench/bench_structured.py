"""Grammar overhead: batch-8 decode tokens/s with every request constrained by a JSON schema vs unconstrained.

    python bench/bench_structured.py [--model examples/tiny-llama] [--quick] [--repeats 3] [--profile]

Both sides run the same 8 code prompts at once (batch 8), sampled at temperature 1 with the same seeds, for
exactly --max-tokens tokens each: the unconstrained side ignores EOS, and the schema (a long array of small
records, at least MIN_ITEMS of them) cannot be complete before the token limit, so the batch stays 8 for the whole
run on both sides. A repeat's decode rate is the tokens after each request's first, summed, over the time from the
batch's first token to its last: prefill is not in it. The grammar is compiled before the timed runs (as the
replica does at its edge), so the constrained side pays what serving pays per step: the masks (computed while the
forward pass runs), applying them, and advancing the matchers. Ratio: median constrained rate over median
unconstrained rate.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from common import (
    brief_hotspots,
    code_tokens,
    emit,
    environment,
    interleaved,
    median,
    parse_args,
    print_hotspots,
    print_table,
    profile_hotspots,
    run_engine,
    spread,
)

TARGET = 0.9
BATCH = 8
MIN_ITEMS = 200  # more records than fit in the token limit: no request finishes early
SCHEMA = {
    "type": "array",
    "minItems": MIN_ITEMS,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 8},
            "kind": {"enum": ["file", "dir", "link"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        },
        "required": ["id", "name", "kind", "tags"],
        "additionalProperties": False,
    },
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 256, --quick 96)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra=add_flags)
    from ember_platform import LLM, SamplingParams
    from ember_platform.engine.sampling_params import StructuredOutput

    max_tokens = args.max_tokens or (96 if args.quick else 256)
    engine = LLM(args.model).engine
    prompts = [code_tokens(engine.tokenizer, args.prompt_len, offset=997 * i) for i in range(BATCH)]
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    engine.grammars.compile(structured)
    compile_s = time.perf_counter() - t0

    def params(constrained: bool) -> list[Any]:
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=not constrained,
                               structured=structured if constrained else None) for i in range(BATCH)]

    def measure(constrained: bool) -> tuple[float, list[Any]]:
        timings = run_engine(engine, prompts, params(constrained))
        tokens = sum(t.num_tokens - 1 for t in timings)
        seconds = max(t.total for t in timings) - min(t.ttft for t in timings)
        return tokens / seconds, timings

    for constrained in (False, True):  # warm-up, and the prompts' KV cached alike for both sides
        run_engine(engine, prompts[:1], SamplingParams(temperature=0, max_tokens=8, structured=structured
                                                       if constrained else None))
    masks = engine.structured
    mask_s, wait_s, rows = masks.mask_seconds, masks.mask_wait_seconds, masks.num_masked_rows
    runs = interleaved({"json_schema": lambda: measure(True), "none": lambda: measure(False)}, args.repeats)
    constrained_rates = [r[0] for r in runs["json_schema"]]
    free_rates = [r[0] for r in runs["none"]]
    ratio = median(constrained_rates) / median(free_rates)
    rows = masks.num_masked_rows - rows
    steps = rows / BATCH
    mask_ms = 1e3 * (masks.mask_seconds - mask_s) / steps
    wait_ms = 1e3 * (masks.mask_wait_seconds - wait_s) / steps
    last = runs["json_schema"][-1][1]
    all_full = all(t.num_tokens == max_tokens for r in runs["json_schema"] for t in r[1])
    prefix_valid = all(_json_prefix_ok(engine.tokenizer.decode(t.token_ids)) for t in last)

    print(f"model {args.model} ({str(engine.dtype).removeprefix('torch.')}), {args.threads} threads, batch {BATCH}; "
          f"prompts: {args.prompt_len} tokens of code; {max_tokens} tokens each at temperature 1")
    print(f"grammar compiled once in {1e3 * compile_s:.1f} ms (before the timed runs, as at the replica's edge)")
    print(f"{args.repeats} interleaved repeats (a loaded, shared machine: read the ratio, not the absolute rates)\n")
    print_table(["constraint", "decode tok/s (batch 8): median [min..max]"],
                [["json_schema", spread(constrained_rates)], ["none", spread(free_rates)]])
    print(f"\nratio json_schema/none: {ratio:.3f}x; target >= {TARGET}x: {'met' if ratio >= TARGET else 'MISSED'}")
    print(f"grammar masks: {mask_ms:.3f} ms per step of {BATCH} computed on a background thread during the forward "
          f"pass; the step waited {wait_ms:.3f} ms per step for them")
    print(f"every constrained request ran the full {max_tokens} tokens: {all_full}; outputs are JSON prefixes: "
          f"{prefix_valid}")

    record: dict[str, Any] = {
        "ratio": round(ratio, 3), "target": TARGET, "batch": BATCH, "json_schema_tok_s": round(median(
            constrained_rates), 1), "none_tok_s": round(median(free_rates), 1),
        "json_schema_runs": [round(r, 1) for r in constrained_rates], "none_runs": [round(r, 1) for r in free_rates],
        "compile_ms": round(1e3 * compile_s, 2), "mask_ms_per_step": round(mask_ms, 4),
        "mask_wait_ms_per_step": round(wait_ms, 4), "max_tokens": max_tokens, "prompt_len": args.prompt_len,
        "all_full_length": all_full, "outputs_json_prefixes": prefix_valid,
        "dtype": str(engine.dtype).removeprefix("torch."), **environment(args),
    }
    if args.profile:
        for name, constrained in (("json_schema", True), ("none", False)):
            hot = profile_hotspots(lambda c=constrained: measure(c))
            print_hotspots(f"constraint {name}, batch {BATCH}, {max_tokens} tokens", hot)
            record[f"hotspots_{name}"] = brief_hotspots(hot)
            record[f"phases_pct_{name}"] = hot["phases_pct"]
    name = args.model.resolve().name
    emit("structured" + ("" if name == "tiny-llama" else f"-{name}"), record, args.results)


def _json_prefix_ok(text: str) -> bool:
    """The text starts the array the schema asks for (cut at the token limit, so not complete)."""
    return text.startswith('[{"id": ')


if __name__ == "__main__":
    main()
