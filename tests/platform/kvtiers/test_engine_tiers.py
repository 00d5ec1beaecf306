"""KV tiers in the real engine on the example model: a prefix evicted from a tiny device pool comes back from the
CPU tier, the disk tier or S3 (a moto server) with greedy outputs identical to recomputing it; two engines
share S3; S3 going down, corrupt blocks and another model's blocks all fall back to recomputing."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ember_platform import LLM, SamplingParams
from ember_platform.engine.block_hash import hash_blocks
from ember_platform.engine.outputs import CompletionOutput
from ember_platform.kvtiers import TierEvent, seed

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16
POOL = 16  # device blocks: 256 tokens
PREFIX = 160  # 10 blocks
rng = random.Random(11)
SYSTEM = [rng.randrange(5, 4096) for _ in range(PREFIX)]
FIRST = [*SYSTEM, *(rng.randrange(5, 4096) for _ in range(10))]
SECOND = [*SYSTEM, *(rng.randrange(5, 4096) for _ in range(10))]
FILLER = [rng.randrange(5, 4096) for _ in range(240)]  # with its 8 outputs, the whole pool: evicts everything
SYSTEM_HASHES = hash_blocks(SYSTEM, BLOCK)
CPU_SMALL = 8 * 4 * 2 * 2 * 16 * 64 * 4 / 2**30  # 8 blocks of the example's KV (64 KiB each), in GiB


def others(n: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[*SYSTEM, *(r.randrange(5, 4096) for _ in range(r.randrange(3, 20)))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs with no prefix reuse at all."""
    llm = LLM(EXAMPLE, enable_prefix_caching=False)
    prompts = [FIRST, SECOND, *others(4, 1)]
    return {tuple(p): out.token_ids for p, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True)}


def generate(llm: LLM, prompt: list[int]) -> CompletionOutput:
    return llm.generate([prompt], GREEDY)[0]


def compute_then_evict(llm: LLM) -> None:
    """Serve FIRST (its blocks go down to the tiers), then FILLER, which takes every device block."""
    generate(llm, FIRST)
    generate(llm, FILLER)
    assert llm.engine.kv_tiers is not None and llm.engine.kv_tiers.flush()
    assert not set(SYSTEM_HASHES) & set(llm.engine.kv.pool.cached), "the prefix is still on the device"


def tier_stats(llm: LLM) -> dict[str, float]:
    return {k.removeprefix("kv_tier_"): v for k, v in llm.engine.stats().items() if k.startswith("kv_tier_")}


def s3_option(moto: Any, bucket: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"s3_url": f"s3://{bucket or moto.new_bucket()}/kv", "s3_endpoint_url": moto.url, **extra}


@pytest.mark.parametrize("tier", ["cpu", "disk", "disk-below-cpu", "s3"])
def test_greedy_output_is_identical_when_the_prefix_comes_from_a_tier(tier, reference, tmp_path, moto) -> None:
    option: dict[str, Any] = {
        "cpu": {"cpu_gb": 0.01},
        "disk": {"cpu_gb": 0, "disk_dir": str(tmp_path)},
        # A CPU tier too small to keep the prefix once FILLER went through: served from disk, promoted to CPU.
        "disk-below-cpu": {"cpu_gb": CPU_SMALL, "disk_dir": str(tmp_path)},
        "s3": {"cpu_gb": 0, **s3_option(moto)},
    }[tier]
    llm = LLM(EXAMPLE, num_kv_blocks=POOL, kv_tiers=option)
    compute_then_evict(llm)
    out = generate(llm, SECOND)
    assert out.token_ids == reference[tuple(SECOND)]
    assert out.usage is not None and out.usage.cached_tokens == PREFIX  # the prefill skipped the whole prefix
    stats = tier_stats(llm)
    source = tier.split("-")[0]
    assert stats[f"{source}_hits"] == PREFIX // BLOCK and stats["loaded_tokens"] == PREFIX
    assert llm.engine.kv_tiers.read_bandwidth()[source] > 0  # measured, for routing's fetch-vs-recompute price
    if tier == "disk-below-cpu":
        assert stats.get("cpu_hits", 0) == 0 and stats["cpu_blocks"] == 8
        # Read in the background into the too-small CPU tier once (8 of the 10 blocks fit), the rest inline.
        assert stats["staged_reads"] == 1 and stats["staged_blocks"] == PREFIX // BLOCK
    llm.engine.kv_tiers.close()


def test_two_engines_share_the_s3_tier(reference, moto) -> None:
    bucket = moto.new_bucket()
    a = LLM(EXAMPLE, kv_tiers={"cpu_gb": 0.01, **s3_option(moto, bucket)})
    b = LLM(EXAMPLE, kv_tiers={"cpu_gb": 0.01, **s3_option(moto, bucket)})
    assert generate(a, FIRST).token_ids == reference[tuple(FIRST)]
    assert a.engine.kv_tiers.flush()
    out = generate(b, SECOND)
    assert out.token_ids == reference[tuple(SECOND)]
    assert out.usage.cached_tokens == PREFIX  # B computed only its own suffix
    assert tier_stats(b)["s3_hits"] == PREFIX // BLOCK
    again = generate(b, FIRST)  # now from B's own device cache (S3 blocks were promoted there)
    assert again.token_ids == reference[tuple(FIRST)] and tier_stats(b)["s3_hits"] == PREFIX // BLOCK
    a.engine.kv_tiers.close()
    b.engine.kv_tiers.close()


def test_s3_going_down_mid_run_fails_no_request(reference, own_moto) -> None:
    llm = LLM(EXAMPLE, num_kv_blocks=POOL, max_num_seqs=2,
              kv_tiers={"cpu_gb": 0, **s3_option(own_moto, s3_timeout_s=0.5, s3_breaker_failures=2)})
    compute_then_evict(llm)
    engine = llm.engine
    prompts = [SECOND, *others(4, 1)]
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, GREEDY)
    results: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.finish_reason != "abort"
        step += 1
        if step == 1:  # the first request loaded its prefix from S3; now the endpoint goes away
            own_moto.stop()
    assert [results[f"q{i}"] for i in range(len(prompts))] == [reference[tuple(p)] for p in prompts]
    generate(llm, FILLER)  # evict again: the next lookup must go to S3, which is down
    assert generate(llm, SECOND).token_ids == reference[tuple(SECOND)]
    stats = tier_stats(llm)
    assert stats["s3_hits"] == PREFIX // BLOCK  # before it went down
    assert stats["s3_fallbacks"] >= 1 and stats["s3_errors"] + stats["s3_skipped"] >= 1
    llm.engine.kv_tiers.close(timeout=1)


def test_a_silent_s3_endpoint_costs_a_bounded_wait(reference, silent_endpoint) -> None:
    llm = LLM(EXAMPLE, kv_tiers={"cpu_gb": 0, "s3_url": "s3://bucket/kv", "s3_endpoint_url": silent_endpoint,
                                 "s3_timeout_s": 0.2, "s3_breaker_failures": 1, "s3_breaker_cooldown_s": 60})
    t0 = time.perf_counter()
    outs = [generate(llm, p) for p in others(4, 1)]
    assert time.perf_counter() - t0 < 10
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in others(4, 1)]
    stats = tier_stats(llm)
    assert stats["s3_breaker_open"] == 1 and stats["s3_skipped"] >= 1
    llm.engine.kv_tiers.close(timeout=0)


def test_requests_run_while_another_ones_prefix_is_read_from_a_slow_s3(reference, silent_endpoint) -> None:
    """With a CPU tier, S3 is read in the background: a request whose prefix might be in S3 waits for the read
    (here: to its 1 s timeout, then it recomputes); the others are scheduled meanwhile, not stalled behind it."""
    llm = LLM(EXAMPLE, kv_tiers={"cpu_gb": 0.01, "s3_url": "s3://bucket/kv", "s3_endpoint_url": silent_endpoint,
                                 "s3_timeout_s": 1.0, "s3_breaker_failures": 1, "s3_breaker_cooldown_s": 60})
    engine = llm.engine
    tiered, plain = SECOND, [7, 8, 9]  # `plain` has no full block: nothing to look up below the device
    engine.add_request("tiered", tiered, GREEDY)
    engine.add_request("plain", plain, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outputs: dict[str, list[int]] = {"tiered": [], "plain": []}
    plain_done_while_reading = None
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.request_id == "plain" and out.finished:
                plain_done_while_reading = engine.scheduler.num_loading == 1 and not outputs["tiered"]
        assert time.perf_counter() - t0 < 30
    assert plain_done_while_reading, "the request without a tiered prefix waited for the S3 read"
    assert outputs["tiered"] == reference[tuple(SECOND)]  # recomputed after the read timed out
    stats = tier_stats(llm)
    assert stats["staged_reads"] >= 1 and stats["s3_fallbacks"] >= 1
    llm.engine.kv_tiers.close(timeout=0)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_block_is_dropped_and_recomputed(damage, reference, tmp_path) -> None:
    llm = LLM(EXAMPLE, num_kv_blocks=POOL, kv_tiers={"cpu_gb": 0, "disk_dir": str(tmp_path)})
    compute_then_evict(llm)
    disk = llm.engine.kv_tiers.disk
    victim = disk.path(SYSTEM_HASHES[3])
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
    out = generate(llm, SECOND)
    assert out.token_ids == reference[tuple(SECOND)]
    assert out.usage.cached_tokens == 3 * BLOCK  # blocks 0-2 loaded; 3 is bad, so 3.. are recomputed
    stats = tier_stats(llm)
    assert stats["corrupt_blocks"] == 1
    assert llm.engine.kv_tiers.flush()
    # The recomputed block was written through again, intact.
    assert victim.read_bytes() != bytes(data)
    llm.engine.kv_tiers.close()


def test_a_corrupt_s3_object_is_refused(reference, moto) -> None:
    bucket = moto.new_bucket()
    llm = LLM(EXAMPLE, num_kv_blocks=POOL, kv_tiers={"cpu_gb": 0, **s3_option(moto, bucket)})
    compute_then_evict(llm)
    key = llm.engine.kv_tiers.s3.key(SYSTEM_HASHES[0])
    client = moto.client()
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-40] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    out = generate(llm, SECOND)
    assert out.token_ids == reference[tuple(SECOND)] and out.usage.cached_tokens == 0
    assert tier_stats(llm)["corrupt_blocks"] == 1
    llm.engine.kv_tiers.close()


def perturbed_copy(dest: Path) -> Path:
    """The example's weights with one tensor changed: another model with exactly the same KV layout."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(EXAMPLE / "weights", dest)
    tensors = load_file(dest / "model.safetensors")
    name = next(n for n in tensors if n.endswith("layers.0.self_attn.k_proj.weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_another_models_blocks_are_refused(reference, tmp_path) -> None:
    other_dir = perturbed_copy(tmp_path / "other")
    other_reference = generate(LLM(other_dir, enable_prefix_caching=False), SECOND).token_ids
    a = LLM(EXAMPLE, kv_tiers={"cpu_gb": 0, "disk_dir": str(tmp_path / "a")})
    generate(a, FIRST)
    assert a.engine.kv_tiers.flush()
    b = LLM(other_dir, kv_tiers={"cpu_gb": 0, "disk_dir": str(tmp_path / "b")})
    a_layout, b_layout = a.engine.kv_tiers.layout, b.engine.kv_tiers.layout
    assert a_layout.model != b_layout.model and a_layout.block_shape == b_layout.block_shape
    # Stored apart by namespace; put A's files where B looks, as a misconfigured shared store would.
    shutil.copytree(a.engine.kv_tiers.disk.root, b.engine.kv_tiers.disk.root, dirs_exist_ok=True)
    out = generate(b, SECOND)
    assert out.token_ids == other_reference and out.usage.cached_tokens == 0
    assert tier_stats(b)["rejected_blocks"] == 1  # the first block is refused, and the run ends there
    a.engine.kv_tiers.close()
    b.engine.kv_tiers.close()


def test_a_fresh_engine_is_seeded_with_the_hottest_prefixes(reference, moto) -> None:
    bucket = moto.new_bucket()
    a = LLM(EXAMPLE, kv_tiers={"cpu_gb": 0.01, **s3_option(moto, bucket, replica_id="a")})
    a.generate(others(4, 1), GREEDY)  # four prompts share SYSTEM: it is the hot prefix
    assert a.engine.kv_tiers.flush() and a.engine.kv_tiers.publish_hot()
    fresh = LLM(EXAMPLE, kv_tiers={"cpu_gb": 0.01, **s3_option(moto, bucket, replica_id="b")})
    report = seed(fresh.engine, n=4)
    assert report.chains == 1 and report.blocks == PREFIX // BLOCK
    loaded = tier_stats(fresh)["s3_hits"]
    out = generate(fresh, SECOND)
    assert out.token_ids == reference[tuple(SECOND)] and out.usage.cached_tokens == PREFIX
    assert tier_stats(fresh)["s3_hits"] == loaded  # served from the device: nothing fetched on the request path
    # The same at start, from the option (a replica process: `--override kv_tiers={..., "seed_prefixes": 4}`).
    started = LLM(EXAMPLE, kv_tiers={"cpu_gb": 0.01, "seed_prefixes": 4, **s3_option(moto, bucket, replica_id="c")})
    assert started.engine.timings["kv_seed"] > 0
    assert all(started.engine.kv.pool.lookup(h) is not None for h in SYSTEM_HASHES)
    assert generate(started, SECOND).usage.cached_tokens == PREFIX
    for llm in (a, fresh, started):
        llm.engine.kv_tiers.close()


def test_tier_membership_events_for_routing(tmp_path) -> None:
    llm = LLM(EXAMPLE, num_kv_blocks=POOL, kv_tiers={"cpu_gb": CPU_SMALL, "disk_dir": str(tmp_path)})
    events: list[TierEvent] = []
    llm.engine.kv_tiers.add_listener(events.append)
    compute_then_evict(llm)
    prefix = SYSTEM_HASHES
    stored = {tier: [h for e in events if e.tier == tier for h in e.stored] for tier in ("cpu", "disk")}
    removed = {tier: [h for e in events if e.tier == tier for h in e.removed] for tier in ("cpu", "disk")}
    # 8 CPU slots: the first 8 prefix blocks fit (the other two go to disk only), then FILLER pushed them out.
    assert stored["cpu"][:8] == prefix[:8] and set(prefix) <= set(stored["disk"])
    assert set(prefix[:8]) <= set(removed["cpu"]) and not removed["disk"]
    membership = llm.engine.kv_tiers.membership()
    assert set(prefix) <= set(membership["disk"]) and not set(prefix) & set(membership["cpu"])
    llm.engine.kv_tiers.close()


def test_engine_option_errors_name_the_key() -> None:
    with pytest.raises(TypeError, match="'cpu_gib' \\(did you mean 'cpu_gb'\\?\\)"):
        LLM(EXAMPLE, kv_tiers={"cpu_gib": 1})
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(EXAMPLE, enable_prefix_caching=False, kv_tiers={"cpu_gb": 0.01})


def test_tiers_off_by_default() -> None:
    llm = LLM(EXAMPLE)
    assert llm.engine.kv_tiers is None and llm.engine.kv.tiers is None
    assert not any(k.startswith("kv_tier_") for k in llm.engine.stats())


def test_kv_dtype_round_trips_in_bfloat16(tmp_path) -> None:
    """bf16 caches (the usual GPU dtype) go through the disk format bit for bit."""
    llm = LLM(EXAMPLE, dtype="bfloat16", num_kv_blocks=POOL, kv_tiers={"cpu_gb": 0, "disk_dir": str(tmp_path)})
    assert llm.engine.kv_tiers.layout.dtype == "bfloat16"
    generate(llm, FIRST)
    assert llm.engine.kv_tiers.flush()
    store = llm.engine.kv_tiers
    h = SYSTEM_HASHES[0]
    block_id = llm.engine.kv.pool.lookup(h)
    fetched = store.fetch([h])
    k_cache = store.kv_caches[0][0]
    assert fetched and torch.equal(fetched[0].data[0, 0], k_cache[block_id])
    store.release(fetched)
    store.close()
