"""Cold start: a replica process's first start (load full precision, quantize) vs the next one (quantized weights
from the cold-start cache), and waking a sleeping engine vs a cold start.

    python bench/bench_cold_start.py [--model bench/models/llama-150m] [--quantization int8] [--repeats 3]

Each repeat: empty quantized-weight cache -> start `python -m ember_platform.replica` (time from spawn to its ready
line, and the phases it reports in /info: load, quantize, warm-up) -> stop -> start again (cache filled) -> stop.
After each start's first request, the replica is put to sleep (`POST /sleep`: KV cache released, weights kept) and
the next request wakes it: its time to first token over HTTP, against a cold start's spawn-to-first-token.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import LARGE_MODEL, emit, environment, median, parse_args, print_table

READY = "EMBER_REPLICA_READY"


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default="int8", help="quantization method (default int8)")


def start_replica(model: Path, quantization: str, cache: Path, threads: int) -> dict[str, Any]:
    env = {**os.environ, "EMBER_QUANTIZED_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ember_platform.replica", "--package", str(model), "--port", "0",
                             "--threads", str(threads), "--override", f"quantization={quantization}",
                             "--log-level", "warning", "--no-auth"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            if line.startswith(READY):
                url = line.split()[1]
                break
        if url is None:
            raise RuntimeError(f"the replica exited with {proc.wait()} before it was ready")
        ready_s = time.perf_counter() - t0
        info = httpx.get(f"{url}/info", timeout=30).json()
        t1 = time.perf_counter()
        httpx.post(f"{url}/v1/completions", json={"model": info["name"], "prompt": [1, 2, 3], "max_tokens": 1},
                   timeout=120).raise_for_status()
        first_token_s = ready_s + (time.perf_counter() - t1)
        # Sleep (KV cache released, weights kept), then the next request wakes it: time to its first token.
        httpx.post(f"{url}/sleep", timeout=30).raise_for_status()
        assert httpx.get(f"{url}/info", timeout=30).json()["sleeping"]
        t2 = time.perf_counter()
        httpx.post(f"{url}/v1/completions", json={"model": info["name"], "prompt": [1, 2, 3], "max_tokens": 1},
                   timeout=120).raise_for_status()
        wake_s = time.perf_counter() - t2
        return {"ready_s": ready_s, "first_token_s": first_token_s, "wake_s": wake_s, "phases": info["timings"]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_model=LARGE_MODEL, extra=add_flags)
    first, second, wakes = [], [], []
    with tempfile.TemporaryDirectory(prefix="ember-bench-cold-") as tmp:
        for r in range(args.repeats):
            cache = Path(tmp) / f"cache-{r}"
            first.append(start_replica(args.model, args.quantization, cache, args.threads))
            second.append(start_replica(args.model, args.quantization, cache, args.threads))
            wakes.extend(r["wake_s"] for r in (first[-1], second[-1]))

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return median([r[key] for r in runs])

    def phase(runs: list[dict[str, Any]], name: str) -> float:
        return median([r["phases"].get(name) or 0.0 for r in runs])

    cached_ratio = med(first, "ready_s") / med(second, "ready_s")
    wake_ratio = med(second, "first_token_s") / median(wakes)
    print(f"model {args.model}, quantization {args.quantization}, {args.threads} threads, {args.repeats} repeats")
    print_table(["start", "spawn -> ready s", "load s", "quantize s", "warm-up s", "spawn -> first token s"],
                [[name, f"{med(runs, 'ready_s'):.2f}", f"{phase(runs, 'load'):.2f}", f"{phase(runs, 'quantize'):.2f}",
                  f"{phase(runs, 'warmup'):.2f}", f"{med(runs, 'first_token_s'):.2f}"]
                 for name, runs in (("first (quantize)", first), ("second (cached)", second))])
    print(f"wake from sleep -> first token (HTTP, replica process): {1000 * median(wakes):.0f} ms")
    print(f"\nsecond cold start vs first: {cached_ratio:.2f}x faster to ready; "
          f"wake from sleep vs cold start (cached): {wake_ratio:.1f}x faster to the first token")
    emit(f"cold_start-{args.model.resolve().name}", {
        "cached_vs_first": round(cached_ratio, 3), "wake_vs_cold": round(wake_ratio, 2), "first": first,
        "second": second, "wake_s": wakes, "quantization": args.quantization, **environment(args)}, args.results)


if __name__ == "__main__":
    main()
