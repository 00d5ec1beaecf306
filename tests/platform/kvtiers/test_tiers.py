"""The CPU and disk tiers on their own: capacity, least-recently-used eviction, pinning, membership events."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ember_platform.kvtiers.format import KVLayout, encode_block
from ember_platform.kvtiers.tiers import CpuTier, DiskTier

LAYOUT = KVLayout(model="m", dtype="float32", block_size=2, num_layers=1, num_kv_heads=1, head_dim=4)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Events:
    def __init__(self) -> None:
        self.stored: list[bytes] = []
        self.removed: list[bytes] = []

    def __call__(self, tier: str, stored: list[bytes], removed: list[bytes]) -> None:
        self.stored += stored
        self.removed += removed


def test_cpu_tier_evicts_least_recently_used() -> None:
    events = Events()
    tier = CpuTier(LAYOUT, 3, torch.float32, on_change=events)
    slots = tier.reserve([h(0), h(1), h(2)])
    tier.unpin(slots)  # type: ignore[arg-type]
    tier.unpin([tier.acquire(h(0))])  # type: ignore[list-item]  # h(0) is now the most recent
    (slot,) = tier.reserve([h(3)])
    assert slot is not None and h(1) not in tier and h(0) in tier
    assert events.stored == [h(0), h(1), h(2), h(3)] and events.removed == [h(1)]


def test_cpu_tier_never_evicts_a_pinned_slot() -> None:
    tier = CpuTier(LAYOUT, 2, torch.float32)
    pinned = tier.reserve([h(0), h(1)])  # both still pinned (being filled)
    assert tier.reserve([h(2)]) == [None]  # nothing evictable: the new block is not kept
    tier.unpin([pinned[1]])  # type: ignore[list-item]
    assert tier.reserve([h(2)]) == [pinned[1]] and h(0) in tier and h(1) not in tier


def test_cpu_tier_skips_blocks_it_holds() -> None:
    tier = CpuTier(LAYOUT, 4, torch.float32)
    tier.unpin(tier.reserve([h(0)]))  # type: ignore[arg-type]
    assert tier.reserve([h(0)]) == [None] and len(tier) == 1


def blob(i: int) -> list[bytes | memoryview]:
    return encode_block(LAYOUT, h(i), bytes([i]) * LAYOUT.block_bytes)


def test_disk_tier_round_trip_and_capacity(tmp_path: Path) -> None:
    size = sum(len(c) for c in blob(0))
    events = Events()
    tier = DiskTier(tmp_path, LAYOUT, capacity_bytes=2 * size, on_change=events)
    tier.put(h(0), blob(0))
    tier.put(h(1), blob(1))
    assert tier.get(h(0)) == b"".join(blob(0))  # h(0) is now the most recent
    tier.put(h(2), blob(2))
    assert h(1) not in tier and not tier.path(h(1)).exists() and tier.get(h(1)) is None
    assert tier.num_bytes == 2 * size and events.removed == [h(1)]
    assert not list(tmp_path.rglob(".tmp-*"))  # writes are atomic: no temporary file left


def test_disk_tier_survives_a_restart_in_lru_order(tmp_path: Path) -> None:
    size = sum(len(c) for c in blob(0))
    first = DiskTier(tmp_path, LAYOUT, capacity_bytes=10 * size)
    for i in range(3):
        first.put(h(i), blob(i))
        os.utime(first.path(h(i)), (time.time() + i, time.time() + i))  # distinct mtimes
    os.utime(first.path(h(0)), (time.time() + 10, time.time() + 10))  # h(0) was read last
    again = DiskTier(tmp_path, LAYOUT, capacity_bytes=2 * size)  # smaller: the oldest goes at start-up
    assert set(again.hashes()) == {h(0), h(2)}


def test_disk_tier_finds_a_block_another_process_wrote(tmp_path: Path) -> None:
    mine = DiskTier(tmp_path, LAYOUT, capacity_bytes=1 << 20)
    theirs = DiskTier(tmp_path, LAYOUT, capacity_bytes=1 << 20)
    theirs.put(h(7), blob(7))
    assert h(7) not in mine and mine.get(h(7)) is not None and h(7) in mine


def test_disk_tier_keeps_models_apart(tmp_path: Path) -> None:
    other = KVLayout(model="other", dtype="float32", block_size=2, num_layers=1, num_kv_heads=1, head_dim=4)
    DiskTier(tmp_path, LAYOUT, 1 << 20).put(h(0), blob(0))
    assert DiskTier(tmp_path, other, 1 << 20).get(h(0)) is None


def test_disk_tier_discard(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, LAYOUT, 1 << 20)
    tier.put(h(0), blob(0))
    tier.discard(h(0))
    assert h(0) not in tier and tier.get(h(0)) is None


def test_disk_tier_smaller_than_a_block_keeps_nothing(tmp_path: Path) -> None:
    events = Events()
    tier = DiskTier(tmp_path, LAYOUT, 0, on_change=events)
    tier.put(h(0), blob(0))
    assert len(tier) == 0 and events.stored == []
