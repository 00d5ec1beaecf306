"""The KV cache manager with tiers below the device, driven by the real scheduler and a simulated model that
checks every KV slot it reads (as tests/platform/engine/test_scheduler.py does), with an in-memory connector
that really moves the slots' contents: blocks loaded from a tier must read back exactly what was computed."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ember_platform.engine.block_hash import BlockHash
from ember_platform.engine.kv_cache_manager import KVCacheManager
from ember_platform.engine.request import Request, RequestStatus
from ember_platform.engine.scheduler import Scheduler

BLOCK = 4


class Params:
    """The scheduler reads nothing from sampling params."""


class MemoryTiers:
    """A KVTierConnector over a dict: saves copy the device slots' contents, loads copy them back."""

    def __init__(self, device: dict[int, tuple[int, int]]) -> None:
        self.device = device  # slot -> (position, token): what the simulated model wrote
        self.blocks: dict[BlockHash, list[tuple[int, int] | None]] = {}
        self.num_saved = self.num_loaded = 0
        self.fail_loads = False
        self.noted: list[list[BlockHash]] = []
        self.slow_stages = 0  # the next this many `stage` calls answer "still reading in the background"

    def save(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        for b, h in zip(block_ids, block_hashes, strict=True):
            self.blocks[h] = [self.device.get(b * BLOCK + i) for i in range(BLOCK)]
            self.num_saved += 1

    def stage(self, block_hashes: Sequence[BlockHash]) -> bool:
        if self.slow_stages and block_hashes[0] in self.blocks:
            self.slow_stages -= 1
            return False
        return True

    def fetch(self, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, list]]:
        out = []
        for h in block_hashes:
            if h not in self.blocks:
                break
            out.append((h, self.blocks[h]))
        return out

    def load(self, fetched: Sequence[tuple[BlockHash, list]], block_ids: Sequence[int]) -> None:
        if self.fail_loads:
            raise RuntimeError("simulated copy failure")
        for (_h, content), b in zip(fetched, block_ids, strict=True):
            for i, entry in enumerate(content):
                if entry is not None:
                    self.device[b * BLOCK + i] = entry
            self.num_loaded += 1

    def release(self, fetched: Sequence[object]) -> None:
        pass

    def note_prefix(self, block_hashes: Sequence[BlockHash]) -> None:
        self.noted.append(list(block_hashes))


def simulate(prompts: list[list[int]], num_blocks: int, tiers: MemoryTiers | None, device: dict[int, tuple[int, int]],
             budget: int = 64) -> tuple[dict[str, list[int]], dict[str, int], KVCacheManager]:
    """Run prompts one after another (each to 4 tokens); return outputs and each request's cached tokens."""
    kv = KVCacheManager(num_blocks, BLOCK, tiers=tiers)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=4096)
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        req = Request(f"r{i}", prompt, Params(), arrival=i)  # type: ignore[arg-type]
        sched.add(req)
        while sched.has_unfinished():
            batch = sched.schedule()
            for r, n in zip(batch.requests, batch.num_tokens, strict=True):
                start = r.num_computed_tokens
                for pos in range(start):
                    slot = r.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK
                    assert device.get(slot) == (pos, r.token_at(pos)), f"{r.request_id} reads stale KV at {pos}"
                for pos in range(start, start + n):
                    device[r.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK] = (pos, r.token_at(pos))
                r.num_computed_tokens += n
                kv.cache_blocks(r)
                if r.num_computed_tokens == r.num_tokens:
                    r.output_token_ids.append(sum(r.all_token_ids[-3:]) % 997)
                    if len(r.output_token_ids) >= 4:
                        outputs[r.request_id] = list(r.output_token_ids)
                        cached[r.request_id] = r.num_cached_tokens
                        sched.finish(r, RequestStatus.FINISHED_LENGTH)
    return outputs, cached, kv


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    return [rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))] for _ in range(30)]


def test_blocks_evicted_from_a_tiny_pool_come_back_from_the_tier_intact() -> None:
    prompts = workload()
    reference, _, _ = simulate(prompts, num_blocks=64, tiers=None, device={})
    device: dict[int, tuple[int, int]] = {}
    tiers = MemoryTiers(device)
    outputs, cached, kv = simulate(prompts, num_blocks=16, tiers=tiers, device=device)  # prefixes get evicted
    assert outputs == reference
    assert tiers.num_loaded > 0 and tiers.num_saved > 0
    assert kv.num_free_blocks == kv.num_blocks
    assert sum(cached.values()) > 0 and kv.prefix_hit_rate > 0


def test_tier_hits_count_as_cached_and_computed_tokens() -> None:
    device: dict[int, tuple[int, int]] = {}
    tiers = MemoryTiers(device)
    prompt = list(range(10, 23))  # 3 full blocks + 1 token
    simulate([prompt], num_blocks=8, tiers=tiers, device=device)
    kv = KVCacheManager(8, BLOCK, tiers=tiers)  # a fresh device pool: everything must come from the tier
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=4096)
    req = Request("again", prompt, Params(), arrival=0)  # type: ignore[arg-type]
    sched.add(req)
    batch = sched.schedule()
    assert batch.num_tokens == [1] and req.num_computed_tokens == req.num_cached_tokens == 12
    assert [kv.pool.lookup(h) for h in req.block_hashes[:3]] == req.block_ids[:3]  # registered on the device
    assert kv.drain_events().stored == req.block_hashes[:3]  # the router learns they are resident


def test_fresh_blocks_never_evict_the_device_hits_they_continue() -> None:
    device: dict[int, tuple[int, int]] = {}
    tiers = MemoryTiers(device)
    prompt = list(range(100, 117))  # 4 full blocks + 1
    simulate([prompt], num_blocks=8, tiers=tiers, device=device)
    kv = KVCacheManager(5, BLOCK, tiers=tiers)
    req = Request("r", prompt, Params(), arrival=0)  # type: ignore[arg-type]
    req.update_block_hashes(BLOCK)
    # Block 0 of the prefix is on the device, cached and free, at the head of the free queue (evicted first).
    (b0,) = kv.pool.allocate(1)
    kv.pool.cache(b0, req.block_hashes[0])
    kv.pool.release([b0])
    kv.pool.free.move_to_end(b0, last=False)
    hits, tokens = kv.get_computed_blocks(req)
    assert hits[0] == b0 and len(set(hits)) == 4 and tokens == 16


def test_a_failed_load_recomputes_and_leaks_nothing() -> None:
    device: dict[int, tuple[int, int]] = {}
    tiers = MemoryTiers(device)
    prompt = list(range(50, 63))
    simulate([prompt], num_blocks=8, tiers=tiers, device=device)
    tiers.fail_loads = True
    kv = KVCacheManager(8, BLOCK, tiers=tiers)
    req = Request("r", prompt, Params(), arrival=0)  # type: ignore[arg-type]
    assert kv.get_computed_blocks(req) == ([], 0)
    assert kv.num_free_blocks == 8 and not kv.pool.cached


def test_lora_requests_stay_on_the_device() -> None:
    device: dict[int, tuple[int, int]] = {}
    tiers = MemoryTiers(device)
    kv = KVCacheManager(8, BLOCK, tiers=tiers)
    req = Request("r", list(range(13)), Params(), arrival=0, lora_name="sql")  # type: ignore[arg-type]
    kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, 13)
    req.num_computed_tokens = 13
    kv.cache_blocks(req)
    assert tiers.num_saved == 0 and tiers.noted == []


def test_prompts_are_noted_once_for_hot_prefixes() -> None:
    device: dict[int, tuple[int, int]] = {}
    tiers = MemoryTiers(device)
    simulate([list(range(9))], num_blocks=8, tiers=tiers, device=device)  # 2 full blocks
    assert len(tiers.noted) == 1 and len(tiers.noted[0]) == 2


def test_a_request_whose_prefix_is_being_read_waits_while_the_others_run() -> None:
    device: dict[int, tuple[int, int]] = {}
    tiers = MemoryTiers(device)
    prompt = list(range(10, 23))  # 3 full blocks + 1 token, in the tier after this
    simulate([prompt], num_blocks=8, tiers=tiers, device=device)
    kv = KVCacheManager(16, BLOCK, tiers=tiers)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=4096)
    early = Request("early", prompt, Params(), arrival=0)  # type: ignore[arg-type]
    late = Request("late", list(range(500, 506)), Params(), arrival=1)  # type: ignore[arg-type]
    sched.add(early)
    sched.add(late)
    tiers.slow_stages = 2  # early's prefix takes two steps to arrive from the tier

    batch = sched.schedule()
    assert batch.requests == [late] and sched.num_loading == 1  # the later request does not wait for it
    assert list(sched.waiting) == [early] and early.num_computed_tokens == 0 and not early.block_ids
    late.num_computed_tokens += batch.num_tokens[0]
    assert sched.schedule().requests == [late] and sched.num_loading == 1
    late.num_computed_tokens += 1
    batch = sched.schedule()  # read: admitted with its three blocks as cache hits, nothing recomputed
    assert batch.requests == [late, early] and batch.num_tokens[1] == 1 and sched.num_loading == 0
    assert early.num_cached_tokens == 12 and tiers.num_loaded == 3
