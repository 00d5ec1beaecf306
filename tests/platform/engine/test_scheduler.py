"""Scheduler + KV cache manager, driven by a simulated model that checks every KV slot it reads.

The simulated model "writes" each computed token into its slot and, before computing, checks
that every earlier position of the request reads back the right token through the block
table — so prefix-cache hits, preemption and chunking are checked for correctness, not just
for counts. The real model runs through the same scheduler in test_engine.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from ember_platform.engine.block_hash import ROOT_PARENT, extra_keys, hash_block, hash_blocks
from ember_platform.engine.kv_cache_manager import KVCacheManager
from ember_platform.engine.request import Request, RequestStatus
from ember_platform.engine.scheduler import Scheduler


class Params:
    """The scheduler reads nothing from sampling params; this stands in for them."""


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 1000


def simulate(prompts: list[list[int]], *, num_blocks: int, block_size: int = 4, budget: int = 64,
             max_seqs: int = 8, max_tokens: int = 12, caching: bool = True, arrivals: list[int] | None = None,
             on_step: Callable[[Scheduler], None] | None = None) -> tuple[dict[str, list[int]], KVCacheManager, int]:
    kv = KVCacheManager(num_blocks, block_size, caching)
    sched = Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096)
    slots: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
    arrivals = arrivals or [0] * len(prompts)
    pending = sorted(((arrivals[i], i) for i in range(len(prompts))), reverse=True)
    outputs: dict[str, list[int]] = {}
    steps = preemptions = 0
    while pending or sched.has_unfinished():
        while pending and pending[-1][0] <= steps:
            _, i = pending.pop()
            sched.add(Request(f"r{i}", prompts[i], Params(), arrival=i))
        batch = sched.schedule()
        preemptions += len(batch.preempted)
        assert batch.total_tokens <= budget and len(batch) <= max_seqs
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            start = req.num_computed_tokens
            assert len(req.block_ids) * block_size >= start + n, "scheduled tokens without KV slots"
            for pos in range(start):  # everything before must already be in the cache
                slot = req.block_ids[pos // block_size] * block_size + pos % block_size
                assert slots.get(slot) == (pos, req.token_at(pos)), f"{req.request_id} reads stale KV at {pos}"
            for pos in range(start, start + n):
                slot = req.block_ids[pos // block_size] * block_size + pos % block_size
                slots[slot] = (pos, req.token_at(pos))
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(next_token(req.all_token_ids))
                if len(req.output_token_ids) >= max_tokens:
                    outputs[req.request_id] = list(req.output_token_ids)
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
                    continue
            kv.cache_blocks(req)
        if on_step:
            on_step(sched)
        steps += 1
        assert steps < 10_000, "no progress"
    return outputs, kv, preemptions


def reference(prompt: list[int], max_tokens: int = 12) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def make_prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(shared)]
    return [system + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.mark.parametrize(("budget", "num_blocks", "caching"), [
    (64, 256, True), (64, 256, False), (5, 256, True),  # chunked prefill at a tiny budget
    (64, 24, True), (64, 24, False),  # a tiny pool: preemption
])
def test_outputs_independent_of_scheduling(budget: int, num_blocks: int, caching: bool) -> None:
    prompts = make_prompts(16, shared=9)
    outputs, kv, _ = simulate(prompts, num_blocks=num_blocks, budget=budget, caching=caching,
                              arrivals=[i // 2 for i in range(16)])
    assert outputs == {f"r{i}": reference(p) for i, p in enumerate(prompts)}
    assert kv.num_free_blocks == kv.num_blocks  # every block back in the pool


def test_tiny_pool_forces_preemption_and_still_finishes() -> None:
    prompts = make_prompts(12, seed=3)
    outputs, kv, preemptions = simulate(prompts, num_blocks=16, max_tokens=20)
    assert preemptions > 0
    assert outputs == {f"r{i}": reference(p, 20) for i, p in enumerate(prompts)}
    assert kv.num_free_blocks == kv.num_blocks


def test_prefix_cache_hits_skip_shared_system_prompt() -> None:
    prompts = make_prompts(8, shared=32)
    _, kv, _ = simulate(prompts, num_blocks=512, arrivals=[0] + [5] * 7)
    # After the first request computed the 32 shared tokens (8 blocks), the others hit them.
    assert kv.num_prefix_hits >= 7 * 32
    assert 0 < kv.prefix_hit_rate < 1


def test_running_requests_go_first_and_budget_is_respected() -> None:
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=4096)
    a = Request("a", list(range(6)), Params(), arrival=0)
    sched.add(a)
    batch = sched.schedule()
    assert batch.num_tokens == [6]
    a.num_computed_tokens = 6
    a.output_token_ids.append(1)
    b = Request("b", list(range(20)), Params(), arrival=1)
    sched.add(b)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.num_tokens == [1, 9]  # b chunked


def test_max_num_seqs_caps_running() -> None:
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100, max_model_len=4096)
    for i in range(4):
        sched.add(Request(f"r{i}", [1, 2, 3], Params(), arrival=i))
    assert len(sched.schedule()) == 2 and sched.num_waiting == 2


def test_abort_frees_blocks_at_once() -> None:
    kv = KVCacheManager(32, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100, max_model_len=4096)
    reqs = [Request(f"r{i}", list(range(10)), Params(), arrival=i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    assert kv.num_free_blocks < 32
    for r in reqs:
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 32 and not sched.has_unfinished()
    waiting = Request("w", [1], Params(), arrival=9)
    sched.add(waiting)
    sched.finish(waiting, RequestStatus.FINISHED_ABORTED)  # aborting a waiting request works too
    assert not sched.has_unfinished()


def test_request_too_large_for_the_pool_fails_instead_of_stalling() -> None:
    kv = KVCacheManager(4, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100, max_model_len=4096)
    big = Request("big", list(range(40)), Params(), arrival=0)
    sched.add(big)
    assert len(sched.schedule()) == 0
    assert big.status == RequestStatus.FINISHED_LENGTH and not sched.has_unfinished()


def test_eviction_is_lru_and_reported() -> None:
    kv = KVCacheManager(4, 2)
    a = Request("a", [1, 2, 3, 4, 5], Params(), arrival=0)
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_blocks(a)
    assert len(kv.drain_events().stored) == 2
    kv.free(a)
    b = Request("b", [9, 9, 9, 9, 9, 9, 9], Params(), arrival=1)
    assert kv.allocate_slots(b, 7)  # needs all 4 blocks: evicts a's cached blocks
    events = kv.drain_events()
    assert len(events.removed) == 2 and set(events.removed) == set(a.block_hashes)


def test_block_hash_spec_is_stable_and_chained() -> None:
    tokens = list(range(10))
    hashes = hash_blocks(tokens, 4)
    assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    assert hashes[1] == hash_block(hash_block(ROOT_PARENT, tokens[:4]), tokens[4:8])
    # Fixed seed: the same bytes in every process and every run (a regression guard on the spec).
    assert ROOT_PARENT.hex() == "25e1eb802bea6adf8d7f2e7ee687b509"
    assert hashes[0].hex() == "9055fbfd5b514ebc49c3adedeb141f3a"
    assert hash_blocks(tokens, 4, extra_keys(lora="sql")) != hashes
    assert hash_blocks(tokens, 4, extra_keys(salt="tenant-a")) != hashes
    assert hash_blocks([0, 1, 2, 3, 4, 5, 6, 9], 4)[0] == hashes[0]  # prefix property


def test_block_hash_is_identical_across_processes() -> None:
    import subprocess
    import sys

    code = ("from ember_platform.engine.block_hash import hash_blocks; "
            "print(hash_blocks(list(range(32)), 16)[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert outs == {hash_blocks(list(range(32)), 16)[-1].hex() + "\n"}
