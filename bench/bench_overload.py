"""Load shedding: offered load from 0.5x to 10x the model's running capacity against `ember serve` of the example
package, and what gets through: goodput, TTFT, the share of 429s, /health latency during the run.

    python bench/bench_overload.py [--model examples/tiny-llama] [--quick] [--repeats 3] [--threads 1]

The server is `ember serve MODEL --no-auth` (bench_gateway's Server) pinned to one replica ([scaling]
max_replicas = 1), so its running capacity C is the replica's max_num_seqs (--quick: 16 instead of the package's),
and the gateway queues max_queue (default 256, --quick 64) more. One level = `load x C` streamed completions sent
at once (token-id prompts of 32 tokens, 32 output tokens, EOS ignored), with raw httpx (little client CPU), while
another process times GET /health every 50 ms. Each load level is run --repeats times, the levels interleaved
(0.5x 1x 2x 5x 10x, then in reverse, ...), and the median taken.

  goodput      output tokens of whole (200, [DONE]) answers per second of the level's wall time
  ratio        goodput at this load over goodput at 1x (the side-by-side baseline: the same server, not overloaded);
               target: >= 0.9 at 10x (overload is shed, not paid for by the requests that are served)
  TTFT         p50 / p99 of the served requests, from the level's start
  429 share    refused at once (each must carry Retry-After; counted otherwise as "bad")
  bad          anything else: 5xx other than 503 + Retry-After, a cut stream, a lost request (must be 0)
  /health p99  from the probing process
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_gateway import Server
from common import emit, environment, median, parse_args, print_table

LOADS = (0.5, 1.0, 2.0, 5.0, 10.0)
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 32
TARGET = 0.9  # goodput at 10x over goodput at 1x
HEALTH_PROBE = """
import json, sys, time
import httpx
times = []
with httpx.Client(base_url=sys.argv[1], timeout=10) as client:
    while sys.stdin.readline().strip() == "go":
        times.clear()
        deadline = time.monotonic() + float(sys.argv[2])
        while True:
            started = time.perf_counter()
            client.get("/health")
            times.append(time.perf_counter() - started)
            if sys.stdin.closed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        print(json.dumps(times), flush=True)
"""


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(threads=1)  # three processes (client, gateway, replica) share the cores: see bench_gateway


@dataclass(slots=True)
class Level:
    load: float
    offered: int
    wall: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    bad: int = 0
    health: list[float] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.tokens / self.wall if self.wall else math.nan

    @property
    def share_429(self) -> float:
        return self.statuses.get("429", 0) / self.offered


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


async def one(client: Any, model: str, prompt: list[int], t0: float, level: Level) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            status = str(r.status_code)
            level.statuses[status] = level.statuses.get(status, 0) + 1
            if r.status_code != 200:
                await r.aread()
                if r.status_code not in (429, 503) or "retry-after" not in r.headers:
                    level.bad += 1
                return
            ttft, tokens, done = math.nan, 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    level.bad += 1
                    return
                if chunk["choices"] and chunk["choices"][0]["text"] and math.isnan(ttft):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            if not done or tokens != OUTPUT_TOKENS:
                level.bad += 1
                return
            level.tokens += tokens
            level.ttft.append(ttft)
    except Exception as e:  # a lost request: the connection broke, or it timed out
        level.statuses[type(e).__name__] = level.statuses.get(type(e).__name__, 0) + 1
        level.bad += 1


async def run_level(url: str, model: str, load: float, capacity: int, tokenizer: Any, seed: int,
                    probe: subprocess.Popen[str]) -> Level:
    import random

    import httpx
    from common import random_code_tokens

    rng = random.Random(seed)
    level = Level(load, max(1, round(load * capacity)))
    prompts = [random_code_tokens(tokenizer, PROMPT_TOKENS, rng) for _ in range(level.offered)]
    assert probe.stdin is not None and probe.stdout is not None
    probe.stdin.write("go\n")
    probe.stdin.flush()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, model, p, t0, level) for p in prompts))
        level.wall = time.perf_counter() - t0
    level.health = json.loads(probe.stdout.readline())
    return level


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra=add_flags)
    from transformers import AutoTokenizer

    from ember.manifest import load_manifest

    manifest = load_manifest(args.model)
    capacity = 16 if args.quick else manifest.runtime.max_num_seqs
    max_queue = 64 if args.quick else manifest.serving.max_queue
    # Every request here comes from 127.0.0.1, where real overload comes from many addresses: the gateway's cap on
    # connections per client address (gateway/connections.py) would refuse connections beyond it before admission
    # control sees them, so it is off for this server (the caller may set one).
    os.environ.setdefault("EMBER_MAX_CONNECTIONS_PER_CLIENT", "0")
    with tempfile.TemporaryDirectory(prefix="ember-bench-overload-") as tmp:
        package = _pinned_copy(args.model, Path(tmp) / "package", capacity, max_queue)
        server = Server(package, args.threads, Path(tmp))
        server.launch()
        probe = None
        try:
            url = server.wait_ready()
            model = manifest.model.name
            tokenizer = AutoTokenizer.from_pretrained(args.model / manifest.model.weights)
            probe = subprocess.Popen([sys.executable, "-c", HEALTH_PROBE, url, "5"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            asyncio.run(run_level(url, model, 1.0, capacity, tokenizer, 0, probe))  # warm-up
            levels: dict[float, list[Level]] = {load: [] for load in LOADS}
            for r in range(args.repeats):
                for i, load in enumerate(LOADS if r % 2 == 0 else LOADS[::-1]):
                    levels[load].append(asyncio.run(run_level(url, model, load, capacity, tokenizer,
                                                              1000 * r + i + 1, probe)))
        finally:
            if probe is not None:
                probe.kill()
            server.stop()
    base = median(lv.goodput for lv in levels[1.0])
    rows, record = [], []
    for load, runs in levels.items():
        goodput = median(lv.goodput for lv in runs)
        entry = {"load": load, "offered": runs[0].offered, "goodput_tok_s": round(goodput, 1),
                 "ratio_to_1x": round(goodput / base, 3),
                 "ttft_p50_s": round(median(percentile(lv.ttft, 0.5) for lv in runs), 3),
                 "ttft_p99_s": round(median(percentile(lv.ttft, 0.99) for lv in runs), 3),
                 "share_429": round(median(lv.share_429 for lv in runs), 3),
                 "bad": sum(lv.bad for lv in runs),
                 "health_p99_ms": round(1000 * median(percentile(lv.health, 0.99) for lv in runs), 1),
                 "statuses": runs[-1].statuses}
        record.append(entry)
        rows.append([f"{load:g}x", entry["offered"], entry["goodput_tok_s"], f"{entry['ratio_to_1x']:.2f}",
                     f"{entry['ttft_p50_s']:.2f} / {entry['ttft_p99_s']:.2f}", f"{entry['share_429']:.0%}",
                     entry["bad"], entry["health_p99_ms"]])
    print(f"capacity {capacity} running + {max_queue} queued, one replica; {OUTPUT_TOKENS} output tokens each")
    print_table(["load", "offered", "goodput tok/s", "vs 1x", "TTFT p50/p99 s", "429s", "bad", "/health p99 ms"],
                rows)
    ratio_10x = next(e["ratio_to_1x"] for e in record if e["load"] == 10.0)
    print(f"goodput at 10x / at 1x: {ratio_10x:.2f} (target >= {TARGET})")
    emit("bench_overload", {"capacity": capacity, "max_queue": max_queue, "levels": record,
                            "max_connections_per_client": os.environ["EMBER_MAX_CONNECTIONS_PER_CLIENT"],
                            "goodput_ratio_10x": ratio_10x, "target": TARGET, "env": environment(args)},
         args.results)


def _pinned_copy(model: Path, dest: Path, capacity: int, max_queue: int) -> Path:
    """The package copied with one replica at most, `capacity` running sequences and `max_queue` queued."""
    import re
    import shutil

    shutil.copytree(model, dest, ignore=shutil.ignore_patterns("__pycache__", "ember.lock"))
    manifest = dest / "ember.toml"
    text = re.sub(r"(?m)^max_replicas = .*$", "max_replicas = 1", manifest.read_text())
    text = re.sub(r"(?m)^max_num_seqs = .*$", f"max_num_seqs = {capacity}", text)
    if "[serving]" in text:
        raise SystemExit(f"{manifest}: has a [serving] section already; this bench sets its own max_queue")
    manifest.write_text(text + f"\n[serving]\nmax_queue = {max_queue}\n")
    return dest


if __name__ == "__main__":
    main()
