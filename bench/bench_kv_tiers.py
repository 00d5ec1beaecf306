"""KV tiers: time to first token for a long shared prefix that was evicted from the device, served from the CPU
tier, the disk tier or S3, vs recomputing it; and the prefix length from which fetching from S3 beats recomputing.

    python bench/bench_kv_tiers.py [--model bench/models/llama-150m] [--quick] [--repeats 3] [--prefix-len 2000]
        [--s3-lengths 16,32,64,128,256,512,1024] [--no-s3]

One engine, several tier connectors swapped in and out of its KV cache manager. Each repeat takes a fresh
--prefix-len token prefix (a window of standard-library code at a new place) and sends prefix + suffix A with a
store holding all three tiers attached: it is computed and written through to CPU RAM, a local directory and an
S3 bucket (a moto server on loopback; any endpoint with --s3-endpoint). Then, in an order that rotates from
repeat to repeat, each side sends prefix + a fresh suffix after the device prefix cache was emptied (the prefix
is evicted from the device): `recompute` with no tier attached, `cpu`, `disk` and `s3` each with a store of that
tier alone. TTFT is measured in the engine's step loop, add_request to the first token, as in
bench_prefix_ttft.py; every tier hit is checked to have skipped the whole prefix. Ratio per tier: median
recompute TTFT over median tier TTFT. The S3 sweep repeats recompute vs s3 at shorter prefix lengths.
Disk reads come from the page cache here (the block was just written): a cold disk adds its read time.

Cross-replica reuse: a second engine, replica B (its own device pool, and a CPU tier plus the same S3 bucket, as
a replica would run), sends each prefix A computed with a fresh suffix: `b-s3` loads it from S3 (read in the
background into B's CPU tier while B's step loop waits), `b-recompute` is B with its tiers detached.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import (
    LARGE_MODEL,
    emit,
    environment,
    greedy,
    median,
    parse_args,
    print_table,
    random_code_tokens,
    run_engine,
    spread,
)

TARGET_CPU = 3.0
SIDES = ("recompute", "cpu", "disk", "s3")
AWS_DUMMY = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_EC2_METADATA_DISABLED": "true"}


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-len", type=int, default=None, help="shared prefix tokens (default 2000)")
    parser.add_argument("--suffix-len", type=int, default=32, help="new tokens after it (default 32)")
    parser.add_argument("--s3-lengths", default=None,
                        help="prefix lengths for the S3 crossover sweep (default 16,32,64,128,256,512,1024)")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 tier (no moto server)")
    parser.add_argument("--s3-endpoint", default=None,
                        help="use this S3 endpoint (and --s3-bucket) instead of starting a moto server")
    parser.add_argument("--s3-bucket", default=None, help="an existing bucket at --s3-endpoint")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: the engine's choice)")


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on a free loopback port, for as long as the benchmark runs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **AWS_DUMMY})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on {url}") from None
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], default_model=LARGE_MODEL, extra=add_flags)
    with tempfile.TemporaryDirectory(prefix="ember-kv-bench-") as tmp:
        if args.no_s3:
            run(args, Path(tmp), None, None)
        elif args.s3_endpoint:
            if not args.s3_bucket:
                raise SystemExit("--s3-endpoint needs --s3-bucket (an existing bucket)")
            run(args, Path(tmp), args.s3_endpoint, args.s3_bucket)
        else:
            os.environ.update({k: v for k, v in AWS_DUMMY.items() if k not in os.environ})
            with moto_server() as endpoint:
                import boto3

                bucket = f"ember-kv-bench-{uuid.uuid4().hex[:8]}"
                boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
                run(args, Path(tmp), endpoint, bucket)


def run(args: argparse.Namespace, tmp: Path, endpoint: str | None, bucket: str | None) -> None:
    import random

    from ember_platform import LLM
    from ember_platform.kvtiers import KVTierConfig, KVTierStore

    prefix_len = args.prefix_len or (256 if args.quick else 2000)
    sweep_default = "16,32,64,128" if args.quick else "16,32,64,128,256,512,1024"
    lengths = [int(x) for x in (args.s3_lengths or sweep_default).split(",")]
    suffix = args.suffix_len
    longest = max([prefix_len, *lengths]) + suffix
    num_blocks = 2 * (-(-longest // 16) + 4)  # a prompt and a half: what one request at a time needs
    s3 = {"s3_url": f"s3://{bucket}/kv", "s3_endpoint_url": endpoint} if endpoint else {}
    disk = {"disk_dir": str(tmp / "kv")}
    # The engine's own store is the writer: all tiers at once, so each prefix is computed once per repeat.
    llm = LLM(args.model, num_kv_blocks=num_blocks, kv_tiers={"cpu_gb": 2.0, **disk, **s3},
              **({"dtype": args.dtype} if args.dtype else {}))
    engine = llm.engine
    writer = engine.kv_tiers
    assert writer is not None

    def alone(**option: Any) -> KVTierStore:
        return KVTierStore(KVTierConfig(**{"cpu_gb": 0, **option}), writer.layout, engine.executor.kv_caches,
                           engine.device)

    readers: dict[str, KVTierStore | None] = {"recompute": None, "cpu": writer, "disk": alone(**disk)}
    replica_b = (LLM(args.model, num_kv_blocks=num_blocks, kv_tiers={"cpu_gb": 2.0, **s3},
                     **({"dtype": args.dtype} if args.dtype else {})).engine if s3 else None)
    if s3:
        readers["s3"] = alone(**s3)
    tok = engine.tokenizer
    rng = random.Random(7)
    first_token = greedy(2)  # two tokens: a request finishing in its prefill step caches no blocks (see bench README)
    block = engine.block_size

    b_turns = iter(range(1 << 30))

    def timed(target: Any, tiers: KVTierStore | None, side: str, prefix: list[int]) -> tuple[float, int]:
        """TTFT of prefix + a fresh suffix on `target` (an engine) with `tiers` attached, its device cache emptied;
        checks that the whole prefix was reused (or, with no tiers, none of it)."""
        assert target.kv.pool.reset_prefix_cache(), "blocks still in use after a request finished"
        target.kv.drain_events()
        target.kv.tiers = tiers
        timing = run_engine(target, [prefix + random_code_tokens(tok, suffix, rng)], first_token)[0]
        expected = 0 if tiers is None else (len(prefix) // block) * block
        if timing.cached_tokens != expected:
            raise RuntimeError(f"{side}: {timing.cached_tokens} prefix tokens reused, expected {expected}")
        return timing.ttft, timing.cached_tokens

    def one_prefix(length: int, sides: list[str], with_b: bool = False) -> dict[str, tuple[float, int]]:
        """Compute a fresh prefix once (written through), then time each side on it with a fresh suffix."""
        prefix = random_code_tokens(tok, length, rng)
        engine.kv.tiers = writer
        run_engine(engine, [prefix + random_code_tokens(tok, suffix, rng)], first_token)
        if not writer.flush(120):
            raise RuntimeError("the disk/S3 writers did not finish in 120 s")
        out = {side: timed(engine, readers[side], side, prefix) for side in sides}
        engine.kv.tiers = writer
        if replica_b is not None and with_b:
            b_tiers = replica_b.kv_tiers
            for side in (["b-recompute", "b-s3"] if next(b_turns) % 2 == 0 else ["b-s3", "b-recompute"]):
                out[side] = timed(replica_b, b_tiers if side == "b-s3" else None, side, prefix)
            replica_b.kv.tiers = b_tiers
        return out

    sides = [s for s in SIDES if s in readers]
    run_engine(engine, [random_code_tokens(tok, 64, rng)], first_token)  # warm-up
    one_prefix(min(lengths), sides, with_b=True)  # warm-up of every path (first S3 connection, first disk files)
    ttft: dict[str, list[float]] = {s: [] for s in sides}
    cross: dict[str, list[float]] = {"b-recompute": [], "b-s3": []}
    for r in range(args.repeats):
        order = sides[r % len(sides):] + sides[:r % len(sides)]  # rotate: machine drift hits every side alike
        for side, (t, _cached) in one_prefix(prefix_len, order, with_b=True).items():
            (cross if side in cross else ttft)[side].append(t)

    sweep: dict[int, dict[str, list[float]]] = {}
    if "s3" in readers:
        for length in lengths:
            sweep[length] = {"recompute": [], "s3": []}
            for r in range(args.repeats):
                order = ["recompute", "s3"] if r % 2 == 0 else ["s3", "recompute"]
                for side, (t, _cached) in one_prefix(length, order).items():
                    sweep[length][side].append(t)
        sweep[prefix_len] = {"recompute": ttft["recompute"], "s3": ttft["s3"]}

    base = median(ttft["recompute"])
    ratios = {side: base / median(ttft[side]) for side in sides if side != "recompute"}
    print(f"model {args.model} ({str(engine.dtype).removeprefix('torch.')}), {args.threads} threads; prefix "
          f"{prefix_len} tokens + suffix {suffix}, KV blocks of {block} tokens, "
          f"{writer.layout.block_bytes / 2**20:.2f} MiB each ({prefix_len // block} blocks per prefix)\n")
    print_table(["prefix served by", "TTFT ms: median [min..max]", "vs recompute"],
                [[side, spread([t * 1e3 for t in ttft[side]]), "1.00x" if side == "recompute"
                  else f"{ratios[side]:.2f}x"] for side in sides])
    crossover = None
    if sweep:
        print("\nS3 vs recompute by prefix length:")
        rows = []
        for length in sorted(sweep):
            rec, s3t = median(sweep[length]["recompute"]), median(sweep[length]["s3"])
            rows.append([length, f"{rec * 1e3:.1f}", f"{s3t * 1e3:.1f}", f"{rec / s3t:.2f}x"])
            if crossover is None and s3t < rec:
                crossover = length
        print_table(["prefix tokens", "recompute ms", "s3 ms", "recompute/s3"], rows)
        print(f"\nS3 fetch beats recomputing from {crossover} prefix tokens on" if crossover is not None
              else "\nS3 fetch did not beat recomputing at any measured length")
    cross_ratio = None
    if cross["b-s3"]:
        cross_ratio = median(cross["b-recompute"]) / median(cross["b-s3"])
        print(f"\nreplica B, prefix computed by A, from the shared S3: TTFT {spread([t * 1e3 for t in cross['b-s3']])} "
              f"ms vs recomputing {spread([t * 1e3 for t in cross['b-recompute']])} ms: {cross_ratio:.2f}x")
    # What the stores measured while serving the hits: bytes/s of reading blocks (host -> device for the CPU tier).
    bandwidth = {side: store.read_bandwidth().get(side) for side, store in readers.items() if store is not None}
    print("\nmeasured read bandwidth: " + ", ".join(f"{side} {bw / 2**20:.0f} MiB/s" for side, bw in bandwidth.items()
                                                 if bw))
    met = ratios.get("cpu", 0) >= TARGET_CPU
    print(f"\nCPU tier vs recompute: {ratios.get('cpu', 0):.2f}x; target >= {TARGET_CPU}x: "
          f"{'met' if met else 'MISSED'}")

    record: dict[str, Any] = {
        "ratio_cpu": round(ratios.get("cpu", 0), 3), "ratio_disk": round(ratios.get("disk", 0), 3),
        "ratio_s3": round(ratios["s3"], 3) if "s3" in ratios else None, "target_cpu": TARGET_CPU,
        "ttft_ms": {side: round(median(v) * 1e3, 2) for side, v in ttft.items()},
        "runs_ms": {side: [round(t * 1e3, 2) for t in v] for side, v in ttft.items()},
        "s3_crossover_tokens": crossover,
        "ratio_replica_b_s3": round(cross_ratio, 3) if cross_ratio else None,
        "replica_b_ms": {side: [round(t * 1e3, 2) for t in v] for side, v in cross.items()},
        "read_mib_s": {side: round(bw / 2**20, 1) for side, bw in bandwidth.items() if bw},
        "s3_sweep_ms": {str(length): {side: round(median(v) * 1e3, 2) for side, v in sides_.items()}
                        for length, sides_ in sorted(sweep.items())},
        "prefix_len": prefix_len, "suffix_len": suffix, "block_bytes": writer.layout.block_bytes,
        "dtype": str(engine.dtype).removeprefix("torch."), "s3_endpoint": "moto" if endpoint and not args.s3_endpoint
        else args.s3_endpoint, **environment(args),
    }
    for store in {id(s): s for s in readers.values() if s is not None}.values():
        store.close(timeout=5)
    if replica_b is not None:
        replica_b.kv_tiers.close(timeout=5)
    name = args.model.resolve().name
    emit("kv_tiers" + ("" if name == "llama-150m" else f"-{name}") + (f"-{args.dtype}" if args.dtype else ""),
         record, args.results)


if __name__ == "__main__":
    main()
