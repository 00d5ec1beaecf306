"""What the engine benchmarks share: arguments, interleaved repeats and medians, code prompts, the
engine step loop with timings, profiles of where the time goes, and the one-line JSON result."""

from __future__ import annotations

import argparse
import cProfile
import inspect
import itertools
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
EXAMPLE_MODEL = ROOT / "examples" / "tiny-llama"
LARGE_MODEL = BENCH / "models" / "llama-150m"
RESULTS = BENCH / "results"

# --- process setup ---------------------------------------------------------------------------


def ensure_passive_omp() -> None:
    """Re-run this process with OMP_WAIT_POLICY=PASSIVE unless the caller chose a policy (OMP_WAIT_POLICY,
    or libgomp's GOMP_SPINCOUNT: e.g. a bounded spin of 10000, see bench/README.md).

    On a shared 2-core machine, OpenMP's default spin-waiting lets the waiting thread hold a core the
    working thread needs: with 2 threads every small op then costs a scheduler time slice (measured
    here: 30x slower decode for the example model). libgomp reads the policy once, when torch loads
    it, so it must be in the environment before `import torch`: hence a re-exec rather than a setenv.
    """
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def parse_args(description: str, *, default_model: Path = EXAMPLE_MODEL,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The flags every benchmark takes (plus `extra`'s), then process setup: threads, seeds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", type=Path, default=default_model,
                        help=f"Ember package or Hugging Face checkpoint dir (default: {default_model})")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run in under a minute")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side, interleaved (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both sides (default 2)")
    parser.add_argument("--profile", action="store_true", help="also profile Ember and print its hotspots")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"where the JSON goes (default: {RESULTS})")
    if extra:
        extra(parser)
    args = parser.parse_args()
    if not args.model.exists():
        hint = " (make it with `python bench/make_large_model.py`)" if args.model.resolve() == LARGE_MODEL else ""
        parser.error(f"--model {args.model}: no such directory{hint}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    ensure_passive_omp()
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    return args


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Facts that make a result interpretable later: versions, threads, machine load."""
    import torch
    import transformers

    return {
        "model": str(args.model), "threads": args.threads, "repeats": args.repeats, "quick": args.quick,
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
    }


# --- repeats and statistics ------------------------------------------------------------------


def interleaved(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Run each side `repeats` times, alternating which goes first (A B, B A, ...), so that drift in
    the machine's load hits both sides alike. Returns each side's results in run order."""
    results: dict[str, list[Any]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            results[name].append(sides[name]())
    return results


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def spread(values: Sequence[float]) -> str:
    """`median [min..max] (n)` for a table cell."""
    return f"{median(values):.1f} [{min(values):.1f}..{max(values):.1f}] (n={len(values)})"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def emit(name: str, record: dict[str, Any], results_dir: Path = RESULTS) -> None:
    """Write bench/results/<name>.json and print the record as the last line of output."""
    record = {"bench": name, **record}
    line = json.dumps(record, sort_keys=False)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(line + "\n")
    print(line)


# --- workloads -------------------------------------------------------------------------------

CODE_MODULES = ("argparse", "json.decoder", "textwrap", "dataclasses", "functools", "pathlib", "shutil",
                "tokenize", "inspect", "logging", "subprocess", "typing")


def code_text(modules: Sequence[str] = CODE_MODULES) -> str:
    """Real Python source from the standard library (present on every install, offline)."""
    import importlib

    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)


def code_tokens(tokenizer: Any, num_tokens: int, *, offset: int = 0) -> list[int]:
    """`num_tokens` ids of standard-library code (no BOS), starting `offset` tokens in, wrapping around."""
    stream = _code_stream(tokenizer)
    return [stream[(offset + i) % len(stream)] for i in range(num_tokens)]


_STREAMS: dict[int, list[int]] = {}


def _code_stream(tokenizer: Any) -> list[int]:
    key = id(tokenizer)
    if key not in _STREAMS:
        _STREAMS[key] = tokenizer.encode(code_text(), add_special_tokens=False)
    return _STREAMS[key]


def random_code_tokens(tokenizer: Any, num_tokens: int, rng: random.Random) -> list[int]:
    """A window of code at a random place: prompts that differ from their first token on."""
    return code_tokens(tokenizer, num_tokens, offset=rng.randrange(len(_code_stream(tokenizer))))


def model_dtype_name(engine: Any) -> str:
    return str(engine.dtype).removeprefix("torch.")


# --- the engine step loop --------------------------------------------------------------------


@dataclass(slots=True)
class RequestTiming:
    """One request's clock, from `add_request`: first output token, last token, tokens made."""

    prompt_tokens: int
    ttft: float = float("nan")
    total: float = float("nan")
    num_tokens: int = 0
    num_steps: int = 0  # engine steps that gave this request tokens (> 1 token each when drafts are accepted)
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first one (the decode phase alone)."""
        return (self.num_tokens - 1) / (self.total - self.ttft) if self.num_tokens > 1 else float("nan")


_request_ids = itertools.count()


def run_engine(engine: Any, prompts: Sequence[Sequence[int]], params: Any) -> list[RequestTiming]:
    """Submit every prompt at once and step the engine until all are done; per-request timings. `params`: one
    SamplingParams for all, or a list of one per prompt."""
    ids = [f"bench-{next(_request_ids)}" for _ in prompts]
    timings = {rid: RequestTiming(len(p)) for rid, p in zip(ids, prompts, strict=True)}
    per_prompt = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
    t0 = time.perf_counter()
    for rid, prompt, p in zip(ids, prompts, per_prompt, strict=True):
        engine.add_request(rid, prompt, p)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter() - t0
        for out in outputs:
            timing = timings[out.request_id]
            if out.new_token_ids and timing.num_tokens == 0:
                timing.ttft = now
            timing.num_tokens += len(out.new_token_ids)
            timing.token_ids.extend(out.new_token_ids)
            timing.num_steps += bool(out.new_token_ids)
            if out.finished:
                timing.total = now
                timing.cached_tokens = out.usage.cached_tokens
                engine.forget(out.request_id)
    return [timings[rid] for rid in ids]


def greedy(max_tokens: int) -> Any:
    """Greedy sampling params that ignore EOS, so that every run makes exactly `max_tokens` tokens."""
    from ember_platform import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def decode_rate(engine: Any, prompt: Sequence[int], max_tokens: int) -> float:
    """Batch-1 greedy decode tokens/s (time after the first token), ignoring EOS."""
    return run_engine(engine, [prompt], greedy(max_tokens))[0].decode_rate


# --- profiles --------------------------------------------------------------------------------

ENGINE_PHASES = {  # cProfile function keys (file suffix, function) -> phase name, for the breakdown
    ("scheduler.py", "schedule"): "schedule",
    ("model_runner.py", "execute"): "model (execute)",
    ("step_plan.py", "build"): "step plan",
    ("model_runner.py", "plan_metadata"): "  attention metadata",
    ("torch_paged.py", "forward"): "  attention backend",
    ("int8.py", "forward"): "  int8 linears",
    ("step_sampler.py", "sample"): "sample",
    ("engine.py", "_append"): "append + detokenize",
    ("engine.py", "_propose"): "propose (speculator)",
}


def profile_hotspots(fn: Callable[[], Any], top: int = 12) -> dict[str, Any]:
    """Profile `fn` twice: torch.profiler for the top ops by self time, cProfile for the engine's phases
    and the top Python functions. Returns a JSON-able dict; `print_hotspots` shows it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.key and not e.key.startswith("ProfilerStep")]
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    torch_ops = [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 2),
                  "pct": round(100 * e.self_cpu_time_total / total, 1), "calls": e.count} for e in ops]

    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    fn()
    profiler.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    phases = dict.fromkeys(ENGINE_PHASES.values(), 0.0)
    funcs = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.items():
        for (suffix, name), phase in ENGINE_PHASES.items():
            if func == name and filename.endswith(suffix):
                phases[phase] += cumtime
        where = f"{Path(filename).name}:{line}({func})" if line else func
        funcs.append((tottime, cumtime, ncalls, where))
    funcs.sort(reverse=True)
    python = [{"function": w, "tottime_ms": round(t * 1e3, 1), "cumtime_ms": round(c * 1e3, 1), "calls": n}
              for t, c, n, w in funcs[:top]]
    return {"wall_ms": round(wall * 1e3, 1),
            "phases_pct": {k.strip(): round(100 * v / wall, 1) for k, v in phases.items() if v},
            "torch_ops": torch_ops, "python": python}


def print_hotspots(title: str, hot: dict[str, Any]) -> None:
    print(f"\nprofile: {title} (cProfile wall {hot['wall_ms']:.0f} ms)")
    if hot["phases_pct"]:
        print("  engine phases, % of wall: " + ", ".join(f"{k} {v}%" for k, v in hot["phases_pct"].items()))
    print("  top torch ops by self CPU time:")
    print_table(["op", "self ms", "%", "calls"],
                [[o["op"][:60], o["self_ms"], o["pct"], o["calls"]] for o in hot["torch_ops"]])
    print("  top Python functions by own time (cProfile; builtins include torch ops):")
    print_table(["function", "own ms", "cum ms", "calls"],
                [[f["function"][:80], f["tottime_ms"], f["cumtime_ms"], f["calls"]] for f in hot["python"]])


def brief_hotspots(hot: dict[str, Any], n: int = 5) -> list[str]:
    """The few top torch ops as strings, for the JSON line."""
    return [f"{o['op']} {o['pct']}%" for o in hot["torch_ops"][:n]]
