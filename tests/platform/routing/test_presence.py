"""A replica's presence in the Redis routing tables: the prefix blocks it can reuse, from its device cache and from
its CPU KV tier, as gateways see them."""

from __future__ import annotations

import random
import time
from pathlib import Path

from ember_platform import LLM, SamplingParams
from ember_platform.replica.routing import RoutingPresence
from ember_platform.routing import open_tables, request_block_hashes

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
BLOCK = 16


def until(predicate, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_blocks_evicted_from_the_device_but_kept_in_the_cpu_tier_stay_published(redis_server) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    prefix = [rng.randrange(5, 4096) for _ in range(10 * BLOCK)]
    llm = LLM(EXAMPLE, num_kv_blocks=16, kv_tiers={"cpu_gb": 0.01})
    engine = llm.engine
    presence = RoutingPresence(redis_server.url, engine, url="http://127.0.0.1:1", model="tiny-llama-presence",
                               version="0.1.0").start()
    tables = open_tables(redis_server.url)
    hashes = request_block_hashes(prefix, BLOCK)
    try:
        llm.generate([prefix], SamplingParams(max_tokens=2))
        view = until(lambda: next((v for v in tables.snapshot("tiny-llama-presence", hashes)
                                   if v.num_cached_blocks == len(hashes)), None))
        assert view.replica_id == presence.replica_id
        # Other prompts push the prefix out of the 16-block device pool; the CPU tier keeps it.
        for seed in range(3):
            other = [random.Random(seed).randrange(5, 4096) for _ in range(12 * BLOCK)]
            llm.generate([other], SamplingParams(max_tokens=2))
        assert not any(engine.kv.pool.lookup(h) is not None for h in hashes)  # gone from the device
        time.sleep(0.5)  # time for the events to reach the tables
        [view] = tables.snapshot("tiny-llama-presence", hashes)
        assert view.num_cached_blocks == len(hashes)  # still this replica's: reusable from its CPU tier

        # Without the tier, an evicted block would leave the tables: check with a device-only engine.
        plain = LLM(EXAMPLE, num_kv_blocks=16)
        other_presence = RoutingPresence(redis_server.url, plain.engine, url="http://127.0.0.1:2",
                                         model="tiny-llama-plain", version="0.1.0").start()
        try:
            plain.generate([prefix], SamplingParams(max_tokens=2))
            for seed in range(3):
                other = [random.Random(seed).randrange(5, 4096) for _ in range(12 * BLOCK)]
                plain.generate([other], SamplingParams(max_tokens=2))
            time.sleep(0.5)
            [plain_view] = tables.snapshot("tiny-llama-plain", hashes)
            assert plain_view.num_cached_blocks == 0
        finally:
            other_presence.close()
    finally:
        presence.close()
        engine.kv_tiers.close()


def test_tiers_and_a_shared_s3_store_reach_the_tables_with_measured_costs(redis_server, start_moto, aws_sandbox,
                                                                          tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Replica A computes a prefix, which goes down to its CPU tier and to S3; replica B, sharing the S3 store,
    is then seen able to reuse it from S3, A from its CPU: the tier each block would come from, per replica."""
    moto = start_moto(tmp_path / "moto.log")
    engines, presences = [], []
    try:
        option = {"cpu_gb": 0.01, "s3_url": f"s3://{moto.new_bucket()}/kv", "s3_endpoint_url": moto.url}
        for port in (1, 2):
            llm = LLM(EXAMPLE, num_kv_blocks=16, kv_tiers=option)
            engines.append(llm)
            presences.append(RoutingPresence(redis_server.url, llm.engine, url=f"http://127.0.0.1:{port}",
                                             model="tiny-llama-shared", version="0.1.0").start())
        (a, b), (pa, pb) = engines, presences
        assert pa.publisher.shared_store == pb.publisher.shared_store != ""
        tables = open_tables(redis_server.url)
        rng = random.Random(5)
        prefix = [rng.randrange(5, 4096) for _ in range(10 * BLOCK)]
        hashes = request_block_hashes(prefix, BLOCK)

        a.generate([prefix], SamplingParams(max_tokens=2))
        for seed in range(3):  # push the prefix out of A's 16-block device pool
            a.generate([[random.Random(seed).randrange(5, 4096) for _ in range(12 * BLOCK)]],
                       SamplingParams(max_tokens=2))
        assert a.engine.kv_tiers.flush()

        def tiers() -> dict[str, tuple[int, ...]] | None:
            got = {v.replica_id: v.cached_tiers for v in tables.snapshot("tiny-llama-shared", hashes)}
            want = {pa.replica_id: (1,) * len(hashes), pb.replica_id: (3,) * len(hashes)}  # A: CPU, B: S3
            return got if got == want else None

        until(tiers)
        assert a.engine.prefill_tokens_per_s > 0  # A prefilled 160-token prompts: the rate a fetch is priced in

        b.generate([prefix], SamplingParams(max_tokens=2))  # B loads the prefix from S3, measuring S3's bandwidth
        assert b.engine.stats()["kv_tier_s3_hits"] > 0

        def b_on_device_with_costs():  # type: ignore[no-untyped-def]
            view = next(v for v in tables.snapshot("tiny-llama-shared", hashes) if v.replica_id == pb.replica_id)
            costs = view.record.kv_costs
            return view if view.num_device_blocks == len(hashes) and costs.fetch_seconds("s3") else None

        view = until(b_on_device_with_costs)
        assert view.record.kv_costs.block_bytes == b.engine.kv_tiers.layout.block_bytes
    finally:
        for presence in presences:
            presence.close()
        for llm in engines:
            llm.engine.kv_tiers.close()
        moto.stop()
