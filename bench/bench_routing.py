"""KV-aware routing vs round robin: two gateways sharing one Redis, three replicas of the example model.

    python bench/bench_routing.py [--quick] [--repeats 1] [--users 12] [--concurrency 6]

Topology, started fresh for every run (empty KV caches): a real `redis-server`; gateway A (`ember serve
--redis-url`) deploys the example package with 3 replicas that publish heartbeats, loads and KV block events to
Redis; gateway B (`ember serve --redis-url`, its own copy scaled to zero) starts no replica and routes to A's
replicas through the shared tables. Clients (the official `openai` client, streamed, token-id prompts) alternate
between the two gateways. The policy is the gateways' `EMBER_ROUTING`: `kv` (prefix + load + lora scorers) or
`round-robin`.

Workload (fixed seed): 8 "system prompts" of ~1,000 tokens, `--users` requests each with its own 32-token user
suffix, 8 output tokens, shuffled, `--concurrency` in flight. Each replica's KV cache is sized to hold about
three of the eight prefixes (as when many long prompts compete for device memory), so where requests land
decides what is reused. Reported per policy: prompt tokens served from the prefix cache (the responses' usage),
mean and median TTFT (first streamed token, from the client), and requests per replica. Then the hot-spot
check: one system prompt for every request at high concurrency, KV-aware: the distribution over replicas
shows the imbalance bound spreading a prefix that would otherwise pile onto one replica.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench_gateway import Server
from common import emit, environment, median, parse_args, print_table, random_code_tokens

TARGETS = {"cached_ratio": 3.0, "ttft_ratio": 2.0}
SEED = 1234
NUM_PREFIXES = 8
PREFIX_LEN = 1000
SUFFIX_LEN = 32
MAX_TOKENS = 8
KV_CACHE_GB = 0.012  # ~196 blocks of 16 tokens for tiny-llama: about three 1k-token prefixes, with the running ones


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", type=int, default=None, help="requests per system prompt (default 16; quick 4)")
    parser.add_argument("--concurrency", type=int, default=3, help="requests in flight at once (default 3)")
    parser.add_argument("--hot-requests", type=int, default=None, help="hot-spot check requests (default 36)")
    parser.add_argument("--hot-concurrency", type=int, default=24,
                        help="hot-spot check requests in flight (default 24: enough to saturate one replica)")
    parser.add_argument("--hot-only", action="store_true", help="run only the hot-spot check")
    parser.set_defaults(threads=1, repeats=1)


class RoutedServer(Server):
    """`ember serve` with the shared Redis and a routing policy."""

    def __init__(self, model: Path, workdir: Path, redis_url: str, policy: str) -> None:
        super().__init__(model, 1, workdir)
        self.redis_url, self.policy = redis_url, policy

    def command(self) -> list[str]:
        return [*super().command(), "--redis-url", self.redis_url]

    def env(self) -> dict[str, str]:
        return {**super().env(), "EMBER_ROUTING": self.policy}


def package_copy(src: Path, dest: Path, *, replicas: int) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = dest / "ember.toml"
    text = manifest.read_text()
    text = re.sub(r"(?m)^min_replicas = .*$", f"min_replicas = {replicas}", text)
    text = re.sub(r"(?m)^max_replicas = .*$", f"max_replicas = {max(1, replicas)}", text)
    text = re.sub(r"(?m)^prewarm = .*$", f"prewarm = {'true' if replicas else 'false'}", text)
    text = re.sub(r"(?m)^target_concurrency = .*$", "target_concurrency = 1000", text)  # no autoscaling here
    text = text.replace("[runtime]\n", f"[runtime]\nkv_cache_memory_gb = {KV_CACHE_GB}\n", 1)
    manifest.write_text(text)
    subprocess.run([str(Path(sys.executable).with_name("ember")), "build", str(dest)], check=True,
                   capture_output=True)
    return dest


class Redis:
    def __init__(self, workdir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def workload(tokenizer: Any, users: int, *, num_prefixes: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [random_code_tokens(tokenizer, PREFIX_LEN, rng) for _ in range(num_prefixes)]
    prompts = [p + random_code_tokens(tokenizer, SUFFIX_LEN, rng) for p in prefixes for _ in range(users)]
    rng.shuffle(prompts)
    return prompts


async def run_clients(urls: list[str], prompts: list[list[int]], concurrency: int) -> list[dict[str, float]]:
    import openai

    clients = [openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0, timeout=300) for u in urls]
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: list[int]) -> dict[str, float]:
        async with gate:
            start = time.perf_counter()
            ttft = None
            usage = None
            stream = await clients[i % len(clients)].completions.create(
                model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].text:
                    ttft = time.perf_counter() - start
                if chunk.usage is not None:
                    usage = chunk.usage
            assert usage is not None and ttft is not None
            details = usage.prompt_tokens_details
            return {"ttft": ttft, "prompt_tokens": usage.prompt_tokens,
                    "cached_tokens": (details.cached_tokens or 0) if details else 0}

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        for c in clients:
            await c.close()


def replica_distribution(gateway_url: str) -> dict[str, int]:
    info = httpx.get(f"{gateway_url}/models/tiny-llama/info", timeout=10).json()
    out = {}
    for r in info["replicas"]:
        text = httpx.get(f"{r['url']}/metrics", timeout=10).text
        finished = sum(float(m.group(1)) for m in
                       re.finditer(r'^ember_requests_finished_total\{[^}]*\} ([0-9.e+]+)$', text, re.M))
        out[r["id"]] = int(finished)
    return out


def topology_run(args: argparse.Namespace, policy: str, prompts: list[list[int]], concurrency: int,
                 workdir: Path, packages: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    redis = Redis(workdir)
    a = RoutedServer(packages / "pkg-a", workdir / f"{policy}-a", redis.url, policy)
    b = RoutedServer(packages / "pkg-b", workdir / f"{policy}-b", redis.url, policy)
    for s in (a, b):
        s.workdir.mkdir(parents=True, exist_ok=True)
    try:
        a.launch()
        a.wait_ready()
        b.launch()
        b.wait_ready()
        results = asyncio.run(run_clients([a.url, b.url], prompts, concurrency))
        dist = replica_distribution(a.url)
    finally:
        b.stop()
        a.stop()
        redis.stop()
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    ttfts = [r["ttft"] for r in results]
    return {"cached_fraction": cached / prompt_tokens, "cached_tokens": cached, "prompt_tokens": prompt_tokens,
            "ttft_mean_ms": 1000 * sum(ttfts) / len(ttfts), "ttft_median_ms": 1000 * median(ttfts),
            "per_replica": dist}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra=add_flags)
    from ember_platform.engine.text import Tokenizer

    model = Path(args.model)
    tokenizer = Tokenizer.from_dir(model / "weights")
    users = args.users or (4 if args.quick else 16)
    hot_requests = args.hot_requests or (12 if args.quick else 36)
    prompts = workload(tokenizer, users, num_prefixes=NUM_PREFIXES, seed=SEED)
    with tempfile.TemporaryDirectory(prefix="ember-bench-routing-") as tmp:
        workdir = Path(tmp)
        package_copy(model, workdir / "pkg-a", replicas=3)
        package_copy(model, workdir / "pkg-b", replicas=0)
        runs: dict[str, list[dict[str, Any]]] = {"round-robin": [], "kv": []}
        for _ in range(0 if args.hot_only else args.repeats):
            for policy in ("round-robin", "kv"):
                runs[policy].append(topology_run(args, policy, prompts, args.concurrency, workdir / f"run-{policy}",
                                                 workdir))
                shutil.rmtree(workdir / f"run-{policy}", ignore_errors=True)
        hot_prompts = workload(tokenizer, hot_requests, num_prefixes=1, seed=SEED + 1)
        hot = topology_run(args, "kv", hot_prompts, args.hot_concurrency, workdir / "run-hot", workdir)

    hot_line = (f"hot spot ({len(hot_prompts)} requests, one system prompt, {args.hot_concurrency} in flight): "
                f"requests per replica {sorted(hot['per_replica'].values(), reverse=True)}")
    if args.hot_only:
        print(hot_line)
        emit("routing-hot", {"hot_spot": hot, "hot_concurrency": args.hot_concurrency, **environment(args)},
             args.results)
        return

    def med(policy: str, key: str) -> float:
        return median([r[key] for r in runs[policy]])

    cached_ratio = med("kv", "cached_fraction") / max(med("round-robin", "cached_fraction"), 1e-9)
    ttft_ratio = med("round-robin", "ttft_mean_ms") / med("kv", "ttft_mean_ms")
    print(f"{len(prompts)} requests: {NUM_PREFIXES} system prompts of {PREFIX_LEN} tokens x {users} users, "
          f"{args.concurrency} in flight, alternating between 2 gateways; 3 replicas")
    print_table(["policy", "prompt tokens from cache", "mean TTFT ms", "median TTFT ms", "requests per replica"],
                [[p, f"{100 * med(p, 'cached_fraction'):.1f}%", f"{med(p, 'ttft_mean_ms'):.0f}",
                  f"{med(p, 'ttft_median_ms'):.0f}", " ".join(str(v) for v in runs[p][-1]["per_replica"].values())]
                 for p in runs])
    print(f"\nkv / round-robin: {cached_ratio:.2f}x prompt tokens from cache (target >= {TARGETS['cached_ratio']}x), "
          f"{ttft_ratio:.2f}x lower mean TTFT (target >= {TARGETS['ttft_ratio']}x)")
    print(hot_line)
    record = {"cached_ratio": round(cached_ratio, 3), "ttft_ratio": round(ttft_ratio, 3), "targets": TARGETS,
              "met": cached_ratio >= TARGETS["cached_ratio"] and ttft_ratio >= TARGETS["ttft_ratio"],
              "runs": runs, "hot_spot": hot, "workload": {"requests": len(prompts), "prefixes": NUM_PREFIXES,
                                                          "prefix_len": PREFIX_LEN, "users": users,
                                                          "concurrency": args.concurrency, "seed": SEED},
              "kv_cache_gb": KV_CACHE_GB, **environment(args)}
    emit("routing", record, args.results)


if __name__ == "__main__":
    main()
