"""The S3 tier against a real S3 endpoint (moto server), and against endpoints that are down or never answer:
failures are fast, bounded by the timeout, and the circuit breaker stops asking."""

from __future__ import annotations

import time

import pytest

from ember_platform.kvtiers.format import KVLayout, decode_block, encode_block
from ember_platform.kvtiers.s3 import CircuitBreaker, S3Tier, S3Unavailable

LAYOUT = KVLayout(model="m", dtype="float32", block_size=2, num_layers=1, num_kv_heads=1, head_dim=4)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def blob(i: int) -> bytes:
    return b"".join(encode_block(LAYOUT, h(i), bytes([i]) * LAYOUT.block_bytes))


def test_put_get_and_a_miss(moto) -> None:
    bucket = moto.new_bucket()
    tier = S3Tier(f"s3://{bucket}/kv", LAYOUT, endpoint_url=moto.url)
    tier.put(h(1), blob(1))
    assert bytes(decode_block(LAYOUT, h(1), tier.get(h(1)))) == bytes([1]) * LAYOUT.block_bytes
    assert tier.get(h(2)) is None and tier.breaker.state == "closed"
    keys = [o["Key"] for o in moto.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == [f"kv/{LAYOUT.namespace}/{h(1).hex()}.kvb"]


def test_get_run_stops_at_the_first_missing_block(moto) -> None:
    tier = S3Tier(f"s3://{moto.new_bucket()}", LAYOUT, endpoint_url=moto.url, fetch_threads=3)
    for i in (0, 1, 2, 4):
        tier.put(h(i), blob(i))
    assert tier.get_run([h(i) for i in range(6)]) == [blob(0), blob(1), blob(2)]
    assert tier.get_run([h(3), h(4)]) == []


def test_capacity_deletes_this_replicas_oldest_uploads(moto) -> None:
    bucket = moto.new_bucket()
    tier = S3Tier(f"s3://{bucket}", LAYOUT, endpoint_url=moto.url, capacity_bytes=2 * len(blob(0)))
    removed: list[bytes] = []
    tier._on_change = lambda name, stored, gone: removed.extend(gone)
    for i in range(3):
        tier.put(h(i), blob(i))
    assert tier.get(h(0)) is None and tier.get(h(2)) is not None and removed == [h(0)]


def test_a_dead_endpoint_fails_fast_then_the_breaker_skips_it(dead_endpoint: str) -> None:
    tier = S3Tier("s3://bucket", LAYOUT, endpoint_url=dead_endpoint, timeout_s=1.0,
                  breaker=CircuitBreaker(failures=2, cooldown_s=60))
    t0 = time.perf_counter()
    for _ in range(5):
        with pytest.raises(S3Unavailable):
            tier.get(h(0))
    assert time.perf_counter() - t0 < 3.0
    assert tier.num_errors == 2 and tier.num_skipped == 3 and tier.breaker.state == "open"


def test_a_silent_endpoint_costs_one_timeout_then_nothing(silent_endpoint: str) -> None:
    tier = S3Tier("s3://bucket", LAYOUT, endpoint_url=silent_endpoint, timeout_s=0.3,
                  breaker=CircuitBreaker(failures=1, cooldown_s=60))
    t0 = time.perf_counter()
    with pytest.raises(S3Unavailable):
        tier.get_run([h(0), h(1)])
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    with pytest.raises(S3Unavailable):
        tier.get_run([h(0), h(1)])
    assert 0.25 < first < 2.0 and time.perf_counter() - t1 < 0.05  # one read timeout, no retries; then skipped


def test_breaker_half_opens_after_the_cooldown() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures=2, cooldown_s=10, clock=lambda: now[0])
    breaker.failure()
    assert breaker.allow()  # one failure is not enough
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    now[0] = 10.0
    assert breaker.allow() and not breaker.allow()  # one probe at a time
    breaker.failure()  # the probe failed: open for another cooldown
    assert breaker.state == "open" and not breaker.allow()
    now[0] = 20.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow() and breaker.num_opened == 1
