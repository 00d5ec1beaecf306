"""Seeding a fresh replica: load the hottest prefixes — published through the shared S3 tier by the replicas
already serving, or given explicitly — into its device pool (or only its CPU tier) before it takes traffic."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ember_platform.engine.block_hash import BlockHash

if TYPE_CHECKING:
    from ember_platform.engine.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class SeedReport:
    chains: int  # prefixes asked for
    blocks: int  # their blocks now resident where asked (device or CPU tier)
    seconds: float


def seed(engine: LLMEngine, n: int = 16, *, chains: Sequence[Sequence[BlockHash]] | None = None,
         into: Literal["device", "cpu"] = "device") -> SeedReport:
    """Load `chains` (default: the `n` hottest prefixes the store knows of) into the engine.

    Call it before the replica takes requests (it runs on the caller's thread, which must own the engine).
    Into the device, the blocks are cached but free — the first requests hit them, and they are evicted like
    any cached block if the pool is needed; whatever does not fit stays in the CPU tier.
    """
    store = engine.kv_tiers
    if store is None:
        raise ValueError("seeding needs KV tiers: start the engine with the kv_tiers option")
    t0 = time.perf_counter()
    todo = [list(c) for c in chains] if chains is not None else store.hot_prefixes(n)
    blocks = 0
    # Coldest first: if the pool cannot hold them all, the hottest are loaded last and so evicted last.
    for chain in reversed(todo):
        blocks += engine.kv.load_prefix(chain) if into == "device" else store.prefetch(chain)
    return SeedReport(len(todo), blocks, time.perf_counter() - t0)
