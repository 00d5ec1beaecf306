"""Soak: hold twice the model's running capacity against `ember serve` for minutes; watch for leaks and lost requests.

    python bench/soak.py [--minutes 10] [--load 2.0] [--replicas 1] [--max-num-seqs 16] [--sample-s 5]

`ember serve` of a copy of the example package with `--replicas` replicas (no autoscaling) decoding at most
`--max-num-seqs` sequences each: its running capacity is replicas x max_num_seqs streams. The client keeps
`--load` times that many streams open the whole time (an asyncio loop of httpx streams: 3 in 4 completions with
token-id prompts, 1 in 4 chats; prompts of 16..128 tokens of standard-library code, answers of 16..64 tokens),
each worker sending its next request as soon as its last one ended, or after the Retry-After of a 429 / 503.

Every request ends as one of: complete (a finish_reason, then [DONE]); shed (429 or 503 with Retry-After and an
OpenAI error object: the admission control doing its job); error event (an SSE error event, then [DONE]); or
lost (anything else: a 5xx without Retry-After, a cut stream, no [DONE], a request still open 60 s after it was
sent). Lost must be 0.

Every `--sample-s` seconds: resident memory (VmRSS) and open file descriptors of the gateway process and of each
replica process. Growth is measured from the end of the first fifth of the run (allocators, caches and pools fill
up at first) to the end: as a ratio (end / start) and as a least-squares slope in MiB per minute. A replica that
is replaced during the run is reported (its pid changes): that is a crash.

Prints a table, then one JSON line (bench/results/soak.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_gateway import Server
from common import emit, environment, parse_args, print_table, random_code_tokens

MODEL = "tiny-llama"
SEED = 1234
PROMPT_LEN = (16, 128)
OUTPUT_LEN = (16, 64)
REQUEST_BOUND_S = 60.0  # a request still open this long after it was sent is lost (it hung)
WARMUP_FRACTION = 0.2  # growth is measured after the first fifth of the run
TARGETS = {"lost": 0, "rss_growth": 1.10, "fd_growth": 1.10}  # end / start after warm-up, per process


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to hold the load (default 10)")
    parser.add_argument("--load", type=float, default=2.0, help="streams kept open, in running capacities (2.0)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of the model (default 1)")
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="[runtime] max_num_seqs of each replica (default 16: capacity stays small enough for "
                             "one client process to hold twice over on a small machine)")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS / fd samples (default 5)")
    parser.set_defaults(threads=1, repeats=1)


def package_copy(src: Path, dest: Path, *, replicas: int, max_num_seqs: int) -> Path:
    """The example with a fixed replica count (no autoscaling) and `max_num_seqs` per replica."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "ember.lock"))
    manifest = dest / "ember.toml"
    text = manifest.read_text()
    for key, value in {"min_replicas": replicas, "max_replicas": replicas, "prewarm": "true",
                       "target_concurrency": 100_000, "max_num_seqs": max_num_seqs}.items():
        text, found = re.subn(rf"(?m)^{key} = \S+", f"{key} = {value}", text)
        if found != 1:
            raise KeyError(f"{manifest}: expected one '{key} = ...' line, found {found}")
    manifest.write_text(text)
    return dest


# --- processes -----------------------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) / 1024 if match else None


def num_fds(pid: int) -> int | None:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None


@dataclass
class Samples:
    """(seconds since the start, value) per process label."""

    rss: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    fds: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, label: str, t: float, pid: int) -> None:
        rss, fds = rss_mib(pid), num_fds(pid)
        if rss is not None and fds is not None:
            self.rss.setdefault(label, []).append((t, rss))
            self.fds.setdefault(label, []).append((t, float(fds)))


def growth(series: list[tuple[float, float]], after: float) -> dict[str, float]:
    """Start (first sample at or after `after` s), end, end / start, and the slope per minute over those samples."""
    kept = [(t, v) for t, v in series if t >= after] or series[-1:]
    (t0, start), (_, end) = kept[0], kept[-1]
    n = len(kept)
    mean_t = sum(t for t, _ in kept) / n
    mean_v = sum(v for _, v in kept) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in kept)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in kept) / var_t * 60 if var_t else 0.0
    return {"start": round(start, 1), "end": round(end, 1), "max": round(max(v for _, v in kept), 1),
            "ratio": round(end / start, 3) if start else float("nan"), "per_min": round(slope, 2),
            "since_s": round(t0, 1)}


# --- the load ------------------------------------------------------------------------------------------------------


def _error_object(raw: bytes) -> bool:
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()


async def one_request(http: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool) -> tuple[str, float, str]:
    """(outcome, seconds to wait before the next request, detail) for one streamed request."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with asyncio.timeout(REQUEST_BOUND_S), http.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                raw = await r.aread()
                retry_after = r.headers.get("Retry-After")
                if r.status_code in (429, 503) and retry_after is not None and _error_object(raw):
                    return "shed", float(retry_after), ""
                if 400 <= r.status_code < 500 and r.status_code != 429 and _error_object(raw):
                    return "client error", 0.0, f"HTTP {r.status_code}: {raw[:200]!r}"
                return "lost", 0.0, f"HTTP {r.status_code}: {raw[:200]!r}"
            finished = done = errored = False
            async for line in r.aiter_lines():
                if not line:
                    continue
                if done:
                    return "lost", 0.0, "data after [DONE]"
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    errored |= "error" in event
                    finished |= any(c.get("finish_reason") for c in event.get("choices", []))
            if done and errored:
                return "error event", 1.0, ""
            if done and finished:
                return "complete", 0.0, ""
            return "lost", 0.0, "the stream ended without [DONE]" if not done else "[DONE] without a finish_reason"
    except TimeoutError:
        return "lost", 0.0, f"still open after {REQUEST_BOUND_S:.0f} s"
    except (httpx.HTTPError, ValueError) as e:
        return "lost", 0.0, f"{type(e).__name__}: {e}"


async def hold_load(url: str, streams: int, seconds: float, tokenizer: Any, sample: Callable[[float], None],
                    interval: float) -> tuple[Counter[str], list[str], int]:
    """Keep `streams` requests open for `seconds`; `sample(t)` every `interval` s. Outcomes, lost details, tokens."""
    outcomes: Counter[str] = Counter()
    lost: list[str] = []
    tokens = 0
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_BOUND_S, connect=10.0), limits=limits) as http:

        async def worker(seed: int) -> None:
            nonlocal tokens
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                chat = rng.random() < 0.25
                prompt = random_code_tokens(tokenizer, rng.randint(*PROMPT_LEN), rng)
                max_tokens = rng.randint(*OUTPUT_LEN)
                body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                                        "stream": True, "temperature": 0.7, "seed": seed}
                if chat:
                    body["messages"] = [{"role": "user", "content": tokenizer.decode(prompt)}]
                else:
                    body["prompt"] = prompt
                outcome, wait, detail = await one_request(http, url, body, chat)
                outcomes[outcome] += 1
                if outcome == "complete":
                    tokens += max_tokens
                if detail and outcome == "lost":
                    lost.append(detail)
                if wait:
                    await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))

        async def sampler() -> None:
            start = time.monotonic()
            while time.monotonic() < deadline:
                await asyncio.to_thread(sample, time.monotonic() - start)
                await asyncio.sleep(interval)
            await asyncio.to_thread(sample, time.monotonic() - start)

        await asyncio.gather(sampler(), *(worker(SEED + i) for i in range(streams)))
    return outcomes, lost, tokens


# --- main ----------------------------------------------------------------------------------------------------------


def replica_pids(url: str) -> dict[str, int]:
    response = httpx.get(f"{url}/admin/deployments/{MODEL}", timeout=30)
    response.raise_for_status()
    return {r["id"]: r["pid"] for r in response.json()["replicas"] if r["pid"] and r["state"] == "ready"}


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra=add_flags)
    if args.quick:
        args.minutes = min(args.minutes, 1.0)
    from ember_platform.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(args.model / "weights")
    capacity = args.replicas * args.max_num_seqs
    streams = max(1, round(args.load * capacity))
    seconds = args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="ember-soak-") as tmp:
        workdir = Path(tmp)
        package = package_copy(args.model, workdir / "pkg", replicas=args.replicas, max_num_seqs=args.max_num_seqs)
        server = Server(package, args.threads, workdir)
        try:
            server.launch()
            url = server.wait_ready()
            pids = replica_pids(url)
            server.replica_pids.update(pids.values())
            assert server.proc is not None
            samples = Samples()
            seen: set[int] = set(pids.values())

            def sample(t: float) -> None:
                samples.add("gateway", t, server.proc.pid)
                for rid, pid in replica_pids(url).items():
                    seen.add(pid)
                    server.replica_pids.add(pid)
                    samples.add(f"replica {rid}", t, pid)

            print(f"holding {streams} streams ({args.load}x a capacity of {capacity}) for {args.minutes:g} min "
                  f"against {url}", flush=True)
            started = time.monotonic()
            outcomes, lost, tokens = asyncio.run(hold_load(url, streams, seconds, tokenizer, sample, args.sample_s))
            wall = time.monotonic() - started
            replaced = len(seen) - len(pids)
        finally:
            server.stop()

    after = seconds * WARMUP_FRACTION
    rss = {label: growth(series, after) for label, series in samples.rss.items()}
    fds = {label: growth(series, after) for label, series in samples.fds.items()}
    total = sum(outcomes.values())
    rows = [[label, f"{rss[label]['start']:.0f} -> {rss[label]['end']:.0f}", f"{rss[label]['ratio']:.3f}",
             f"{rss[label]['per_min']:+.2f}", f"{fds[label]['start']:.0f} -> {fds[label]['end']:.0f}",
             f"{fds[label]['max']:.0f}"] for label in rss]
    print_table(["process", "RSS MiB", "RSS end/start", "MiB/min", "fds", "fds max"], rows)
    print(f"requests: {total} ({dict(outcomes)}); lost {outcomes['lost']}; replicas replaced {replaced}; "
          f"{tokens / wall:.0f} output tokens/s")
    for detail in lost[:10]:
        print(f"  lost: {detail}")
    worst_rss = max(g["ratio"] for g in rss.values())
    worst_fds = max(g["ratio"] for g in fds.values())
    checks = {"lost": outcomes["lost"] == TARGETS["lost"] and replaced == 0,
              "rss_growth": worst_rss <= TARGETS["rss_growth"], "fd_growth": worst_fds <= TARGETS["fd_growth"]}
    emit("soak", {
        "ratios": {"lost": round(outcomes["lost"] / total, 6) if total else None, "rss_growth_max": worst_rss,
                   "fd_growth_max": worst_fds, "shed": round(outcomes["shed"] / total, 4) if total else None},
        "targets": TARGETS, "ok": checks, "minutes": round(wall / 60, 2), "streams": streams,
        "capacity": capacity, "load": args.load, "requests": dict(outcomes), "lost_details": lost[:10],
        "replicas_replaced": replaced, "output_tokens_per_s": round(tokens / wall, 1), "rss_mib": rss, "fds": fds,
        "environment": environment(args)}, args.results)


if __name__ == "__main__":
    main()
