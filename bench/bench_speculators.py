"""Every speculator against no speculation, side by side: decode tokens/s and mean accepted length on held-out code.

    python bench/bench_speculators.py [--methods ngram,medusa,eagle3] [--batches 1,8,32] [--mixed 32] [--quick]
        [--repeats 3]

Prompts are the starts of the standard-library files the example model never trained on (its held-out split,
listed in examples/tiny-llama/training.json), so learned drafters (Medusa) are not measured on text they saw.
For each batch size, each method and "none" run the same prompts with greedy decoding of --max-tokens tokens, EOS
ignored, repeats. Every engine serves its own copy of the queue in lockstep: each takes one step in turn, so that
the load of the machine's other processes falls on all of them alike, step by step, instead of on whichever ran
during a busy spell (on a shared 2-core machine whole-run repeats of the same engine differed by up to 30%,
lockstep runs of two identical engines by under 1%). Batch 1: each prompt alone, one after the other; decode
tokens/s is the tokens after each request's first over the engine's own decode steps. Batch B: B requests kept in
flight (a new one submitted as one finishes) over 3B requests; tokens/s are the tokens after each request's first
over the engine's own step time from its first token on.
Ratios are median rate with the method over median rate without. The methods run with their draft length chosen
adaptively (the engine default: drafts only where measured acceptance and step cost say they pay), so at large
batch a method should fall back to ~1.0x rather than below it; greedy outputs are compared with "none". `--k` is
the most drafts per step each may choose (default 3, and 5 for eagle3, whose head stays accurate deeper: DEFAULT_K).

Methods and where their weights come from: `ngram` (none needed), `medusa` (examples/tiny-llama/speculator/medusa,
made by examples/train_medusa.py), `eagle3` (examples/tiny-llama/speculator/eagle3, made by
examples/train_eagle3.py), `draft` (examples/tiny-llama/speculator/draft, made by examples/train_draft.py). A
method whose weights are missing is reported as skipped. `medusa-tree` is
medusa with `options.tree` (--tree, default 3,2,1: top-3 of head 1, top-2 of head 2 under each, top-1 of head 3)
verified as a tree, with the tree's node count as its node budget (num_speculative_tokens); it is also reported
against chain medusa. `eagle3-tree` is eagle3's dynamic tree (--eagle-tree top-k,depth, default 3,4; node budget
--eagle-tree-budget, default 8).

The mixed run (--mixed B, default 32, also under --quick; 0 skips it) is what serving sees: B requests in flight over
4B (--quick 2B), every other one sampled (temperature 0.8, top-p 0.95, seeded) and the rest greedy, prompts of 32 to
--prompt-len tokens and outputs of 16 to --max-tokens tokens, varied deterministically; every method against none,
with no batch-size ceiling (the adaptive length alone must keep it >= 0.95x); greedy requests' outputs are compared.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import emit, environment, greedy, median, parse_args, print_table, run_engine

HEAD_DIRS = {"medusa": "speculator/medusa", "medusa-tree": "speculator/medusa", "eagle3": "speculator/eagle3",
             "eagle3-tree": "speculator/eagle3", "draft": "speculator/draft"}
VARIANTS = {"medusa-tree": "medusa", "eagle3-tree": "eagle3"}  # bench name -> speculator it runs (options below)
TARGETS_BATCH_1 = {"medusa": 1.5, "ngram": 1.5, "eagle3": 2.0, "draft": 1.5}
TARGET_LARGE_BATCH = 0.95
# The most drafts per step each method may choose (the engine picks 0..k each step from what it measures). EAGLE-3's
# head keeps ~80% acceptance per position past its third draft, so a chain of 5 pays at batch 1 where 3 stops short:
# alternated runs, 2026-12-07: batch 1 2.16-2.48x at k = 5 against 1.96-2.24x at k = 3, 3.35 tokens per step against
# 2.85, and batch 8, 32 and mixed 32 no worse. For draft and ngram 5 and 3 measured the same, and Medusa has 3 heads.
DEFAULT_K = "3,eagle3=5"


def parse_k(text: str) -> dict[str, int]:
    """`--k`: "N" (every method) or "N,METHOD=N,..." -> {"": default, method: k}."""
    out: dict[str, int] = {}
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            method, _, value = part.rpartition("=")
            out[method.strip()] = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or N,METHOD=N,...") from None
    if "" not in out or any(k < 1 for k in out.values()):
        raise argparse.ArgumentTypeError(f"{text!r} needs a default N, every length at least 1")
    return out


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", default="ngram,medusa,eagle3,draft",
                        help="speculators to compare (default: %(default)s)")
    parser.add_argument("--batches", default="1,8,32",
                        help="batch sizes (default: %(default)s; empty: only the mixed run)")
    parser.add_argument("--k", type=parse_k, default=DEFAULT_K,
                        help="num_speculative_tokens, the most the adaptive length may choose: one number for every "
                             "method, or a default and METHOD=N pairs (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 256, --quick 128)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 128, --quick 48)")
    parser.add_argument("--tree", default="3,2,1", help="medusa-tree's top-k per head (default: %(default)s)")
    parser.add_argument("--eagle-tree", default="3,4", help="eagle3-tree's top-k,depth (default: %(default)s)")
    parser.add_argument("--eagle-tree-budget", type=int, default=8, help="eagle3-tree's node budget (default 8)")
    parser.add_argument("--mixed", type=int, default=32,
                        help="batch of the mixed greedy/sampled run (default %(default)s; 0: none)")


def held_out_prompts(tokenizer: Any, model: Path, prompt_len: int) -> list[list[int]]:
    training = json.loads((model / "training.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for rel in training["data"]["held_out"]:
        path = stdlib / rel
        if path.is_file():
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))[:prompt_len]
            if len(ids) == prompt_len:
                prompts.append(ids)
    if not prompts:
        raise SystemExit(f"no held-out file of {prompt_len}+ tokens found under {stdlib}")
    return prompts


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra=add_flags)
    from ember_platform import LLM

    prompt_len = args.prompt_len or (128 if args.quick else 256)
    max_tokens = args.max_tokens or (48 if args.quick else 128)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.quick:
        batches = [b for b in batches if b <= 8] or batches[:1]
    widest = max([*batches, args.mixed])
    lengths = {method: args.k.get(method, args.k[""]) for method in args.methods.split(",")}
    engines: dict[str, Any] = {"none": LLM(args.model, max_num_seqs=widest).engine}
    skipped: dict[str, str] = {}
    for method in args.methods.split(","):
        overrides: dict[str, Any] = {"speculator": VARIANTS.get(method, method),
                                     "num_speculative_tokens": lengths[method],
                                     "max_num_seqs": widest}  # no speculator_max_batch_size: no ceiling
        if method == "medusa-tree":
            tree = [int(k) for k in args.tree.split(",")]
            overrides["speculator_options"] = {"tree": tree}
            overrides["num_speculative_tokens"] = sum(math.prod(tree[:d + 1]) for d in range(len(tree)))
        if method == "eagle3-tree":
            top_k, depth = (int(v) for v in args.eagle_tree.split(","))
            overrides["speculator_options"] = {"tree_top_k": top_k, "tree_depth": depth}
            overrides["num_speculative_tokens"] = args.eagle_tree_budget
        if method in HEAD_DIRS:
            if not (args.model / HEAD_DIRS[method]).is_dir():
                skipped[method] = f"no {HEAD_DIRS[method]} in {args.model}"
                continue
            overrides["speculator_model"] = HEAD_DIRS[method]
        engines[method] = LLM(args.model, **overrides).engine
    prompts = held_out_prompts(engines["none"].tokenizer, args.model, prompt_len)
    params = greedy(max_tokens)
    for engine in engines.values():
        run_engine(engine, prompts[:2], greedy(8))  # warm-up

    def counters(engine: Any) -> tuple[int, int, int]:
        verified = engine.spec.length.num_verified if engine.spec is not None else 0
        return engine.num_draft_tokens, engine.num_accepted_tokens, verified

    def result(engine: Any, before: tuple[int, int, int], tokens: int, seconds: float, cpu: float,
               ids: list[list[int]], steps: int) -> dict[str, Any]:
        drafts, accepted, verified = (now - then for now, then in zip(counters(engine), before, strict=True))
        return {"rate": tokens / seconds, "tokens_per_step": tokens / steps, "cpu_rate": sum(map(len, ids)) / cpu,
                "drafts": drafts, "accepted": accepted, "verified": verified, "token_ids": ids,
                "k": engine.spec.length.k if engine.spec is not None else 0}

    def lockstep(queue: list[list[int]], size: int, each: list[Any] | None = None) -> dict[str, dict[str, Any]]:
        """Every engine serves `queue` with `size` requests in flight (a new one added as one finishes: a closed
        batch would be timed by its slowest request, the one drafts help least), one step each in turn. Timed by
        each engine's own steps from its first token on; `each`: per request params (default `params`)."""
        order = list(engines) if len(runs_so_far) % 2 == 0 else list(engines)[::-1]
        runs_so_far.append(None)
        state = {}
        for name in order:
            state[name] = {"pending": list(enumerate(queue)), "outputs": {}, "seconds": 0.0, "cpu": 0.0,
                           "steps": 0, "started": False, "before": counters(engines[name]),
                           "tag": f"{name}-{len(runs_so_far)}"}
            for _ in range(min(size, len(queue))):
                add(engines[name], state[name], each)
        live = list(order)
        while live:
            for name in list(live):
                engine, st = engines[name], state[name]
                if not engine.has_unfinished():
                    live.remove(name)
                    continue
                wall, cpu = time.perf_counter(), time.process_time()
                outs = engine.step()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                first = any(out.new_token_ids and not st["outputs"][out.request_id] for out in outs)
                if st["started"] and not (size == 1 and first):  # from the first token on; alone, decode steps only
                    st["seconds"] += wall
                st["cpu"] += cpu
                for out in outs:
                    if out.new_token_ids:
                        st["started"] = True
                        st["outputs"][out.request_id] += out.new_token_ids
                        st["steps"] += 1
                    if out.finished:
                        engine.forget(out.request_id)
                        if st["pending"]:
                            add(engine, st, each)
        out = {}
        for name, st in state.items():
            ids = list(st["outputs"].values())
            out[name] = result(engines[name], st["before"], sum(len(t) - 1 for t in ids), st["seconds"], st["cpu"],
                               ids, st["steps"])
        return out

    def add(engine: Any, st: dict[str, Any], each: list[Any] | None) -> None:
        index, prompt = st["pending"].pop(0)
        request_id = f"spec-bench-{st['tag']}-{index}"
        engine.add_request(request_id, prompt, params if each is None else each[index])
        st["outputs"][request_id] = []

    runs_so_far: list[None] = []

    def repeated(run: Callable[[], dict[str, dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, r in run().items():
                results[name].append(r)
        return results

    rows, record = [], {}
    for size in batches:
        queue = prompts if size == 1 else [prompts[i % len(prompts)] for i in range(3 * size)]
        runs = repeated(lambda q=queue, b=size: lockstep(q, b))
        base = median(r["rate"] for r in runs["none"])
        cpu_base = median(r["cpu_rate"] for r in runs["none"])
        for name, results in runs.items():
            rate = median(r["rate"] for r in results)
            cpu_ratio = round(median(r["cpu_rate"] for r in results) / cpu_base, 3)
            drafts = sum(r["drafts"] for r in results)
            accepted = sum(r["accepted"] for r in results)
            same = results[0]["token_ids"] == runs["none"][0]["token_ids"]
            verified = sum(r["verified"] for r in results)
            entry = {"tok_s": round(rate, 1), "ratio": round(rate / base, 3), "cpu_ratio": cpu_ratio,
                     "tokens_per_step": round(median(r["tokens_per_step"] for r in results), 3),
                     "acceptance": round(accepted / drafts, 4) if drafts else None, "identical": same,
                     # tokens per step of the request-steps that verified drafts: accepted drafts + the target's own
                     "mean_accepted_length": round(1 + accepted / verified, 3) if verified else None}
            record[f"{name}@{size}"] = entry
            rows.append([size, name, f"{rate:.1f}", f"{entry['ratio']:.2f}x", f"{cpu_ratio:.2f}x",
                         f"{entry['tokens_per_step']:.2f}",
                         "-" if entry["acceptance"] is None else f"{100 * entry['acceptance']:.0f}%",
                         "-" if entry["mean_accepted_length"] is None else f"{entry['mean_accepted_length']:.2f}",
                         str(same)])

    if args.mixed:
        from ember_platform import SamplingParams

        num_mixed = (2 if args.quick else 4) * args.mixed
        mixed_queue, mixed_params = [], []
        for i in range(num_mixed):  # deterministic variety: lengths cycle through co-prime strides
            length = 32 + (i * 37) % max(1, prompt_len - 31)
            out_len = 16 + (i * 23) % max(1, max_tokens - 15)
            mixed_queue.append(prompts[i % len(prompts)][:length])
            mixed_params.append(SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True) if i % 2 == 0 else
                                SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=out_len,
                                               ignore_eos=True))

        runs = repeated(lambda: lockstep(mixed_queue, args.mixed, mixed_params))
        for results in runs.values():
            for r in results:
                r["token_ids"] = r["token_ids"][::2]  # the greedy half (requests alternate greedy, sampled)
        base = median(r["rate"] for r in runs["none"])
        cpu_base = median(r["cpu_rate"] for r in runs["none"])
        for name, results in runs.items():
            rate = median(r["rate"] for r in results)
            cpu_ratio = round(median(r["cpu_rate"] for r in results) / cpu_base, 3)
            drafts = sum(r["drafts"] for r in results)
            same = results[0]["token_ids"] == runs["none"][0]["token_ids"]
            entry = {"tok_s": round(rate, 1), "ratio": round(rate / base, 3), "cpu_ratio": cpu_ratio,
                     "tokens_per_step": round(median(r["tokens_per_step"] for r in results), 3),
                     "acceptance": round(sum(r["accepted"] for r in results) / drafts, 4) if drafts else None,
                     "identical": same, "last_k": results[-1]["k"]}
            record[f"{name}@mixed{args.mixed}"] = entry
            rows.append([f"mixed {args.mixed}", name, f"{rate:.1f}", f"{entry['ratio']:.2f}x", f"{cpu_ratio:.2f}x",
                         f"{entry['tokens_per_step']:.2f}",
                         "-" if entry["acceptance"] is None else f"{100 * entry['acceptance']:.0f}%", "-",
                         f"{same} (greedy half)"])

    print(f"model {args.model}, {args.threads} threads; {len(prompts)} held-out prompts of {prompt_len} tokens, "
          f"{max_tokens} greedy tokens each; k = {', '.join(f'{m} {k}' for m, k in lengths.items())} (the most "
          f"the adaptive length chooses); {args.repeats} interleaved repeats\n")
    # "vs none (cpu)": tokens (prefill steps included) per CPU-second of this process, against none's: what a busy,
    # shared machine distorts least (wall time waits for the other processes; CPU time mostly does not).
    print_table(["batch", "method", "decode tok/s", "vs none", "vs none (cpu)", "tokens/step", "acceptance",
                 "accepted len", "greedy identical"], rows)
    for method, why in skipped.items():
        print(f"{method}: skipped ({why})")
    verdicts = []
    for method in engines:
        if method == "none":
            continue
        if f"{method}@1" in record and method in TARGETS_BATCH_1:
            ok = record[f"{method}@1"]["ratio"] >= TARGETS_BATCH_1[method]
            verdicts.append(f"{method} batch 1 >= {TARGETS_BATCH_1[method]}x: {'met' if ok else 'MISSED'}")
        large = [s for s in batches if s >= 32]
        for size in large:
            ok = record[f"{method}@{size}"]["ratio"] >= TARGET_LARGE_BATCH
            verdicts.append(f"{method} batch {size} >= {TARGET_LARGE_BATCH}x: {'met' if ok else 'MISSED'}")
        if args.mixed:
            ok = record[f"{method}@mixed{args.mixed}"]["ratio"] >= TARGET_LARGE_BATCH
            verdicts.append(f"{method} mixed batch {args.mixed} >= {TARGET_LARGE_BATCH}x: {'met' if ok else 'MISSED'}")
    for size in batches:  # a tree against the chain of the same heads
        tree, chain = record.get(f"medusa-tree@{size}"), record.get(f"medusa@{size}")
        if tree and chain:
            tree["vs_chain"] = round(tree["tok_s"] / chain["tok_s"], 3) if chain["tok_s"] else None
            verdicts.append(f"medusa-tree vs medusa at batch {size}: {tree['vs_chain']}x decode tok/s, mean accepted "
                            f"length {tree['mean_accepted_length']} vs {chain['mean_accepted_length']}")
    print("\n" + "\n".join(verdicts))
    emit("speculators", {"results": record, "skipped": skipped, "k": lengths, "prompt_len": prompt_len,
                         "max_tokens": max_tokens, "mixed": args.mixed, **environment(args)})


if __name__ == "__main__":
    main()
