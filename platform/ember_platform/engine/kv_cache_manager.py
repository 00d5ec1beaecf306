"""The paged KV cache's bookkeeping: a block pool with refcounts and a prefix cache.

Blocks hold `block_size` tokens of K/V for every layer. A full block that has been computed
is registered under its chained hash (see block_hash.py); a later request whose prompt starts
with the same blocks reuses them instead of recomputing. Blocks with no user stay cached
until they are needed: the free queue is least-recently-freed first, and a request's blocks
are freed tail first, so shared prefixes (the heads) are evicted last.

Every block that enters or leaves the prefix cache is reported as an event; the router
consumes them (`drain_events`).

With KV tiers below the device (a `KVTierConnector`, kvtiers.KVTierStore), each newly cached
block is also handed to the tiers (write-through), and a prefix that misses on the device is
looked up there: the blocks found are loaded into freshly allocated device blocks and registered
in the prefix cache, so the scheduler sees them as ordinary hits (computed, cached tokens). When
the rest of a prefix must come from disk or S3, the tiers read it in the background first and
the request waits for it on the queue (`get_computed_blocks` returns None), not the step loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ember_platform.engine.block_hash import BlockHash
from ember_platform.engine.request import Request

log = logging.getLogger("ember.engine")


@dataclass(slots=True)
class KVEvents:
    """Block hashes that entered (`stored`) or left (`removed`) the prefix cache since the last drain."""

    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)


class KVTierConnector(Protocol):
    """What the KV cache manager needs from the tiers below the device (defined here, torch-free, as the
    scheduler's LoRASlots is). All calls come from the engine's thread."""

    def save(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Newly computed blocks were registered under these hashes: copy them down (must not block on I/O)."""
        ...

    def stage(self, block_hashes: Sequence[BlockHash]) -> bool:
        """Whether `fetch` may run now without waiting on slow I/O; False while a background read of the run
        is under way (the request waits, the step loop does not)."""
        ...

    def fetch(self, block_hashes: Sequence[BlockHash]) -> Sequence[object]:
        """The longest leading run of `block_hashes` the tiers hold, staged on the host; never raises for a
        tier that fails (the run just ends)."""
        ...

    def load(self, fetched: Sequence[object], block_ids: Sequence[int]) -> None:
        """Copy fetched blocks into these device blocks (every layer)."""
        ...

    def release(self, fetched: Sequence[object]) -> None:
        """Give up fetched blocks that will not be loaded."""
        ...

    def note_prefix(self, block_hashes: Sequence[BlockHash]) -> None:
        """A new request's prompt blocks (hot-prefix statistics)."""
        ...


class BlockPool:
    """Refcounted blocks, an LRU queue of free ones, and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = evict first
        self.cached: dict[BlockHash, int] = {}
        self.events = KVEvents()

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (taking free ones off the free queue)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            self._evict(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop a reference; blocks nobody holds go to the tail of the free queue (evicted last)."""
        for b in block_ids:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} released twice"
            if self.ref_cnt[b] == 0:
                self.free[b] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a computed block under its hash; False if it was registered already."""
        if self.block_hash[block_id] is not None:
            return False  # already registered (a prefix-cache hit)
        if block_hash in self.cached:
            return False  # an identical block computed concurrently by another request: keep the first
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        self.events.stored.append(block_hash)
        return True

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
                self.events.removed.append(h)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if len(self.free) != self.num_blocks:
            return False
        for b in range(self.num_blocks):
            self._evict(b)
        return True


class KVCacheManager:
    """Allocates blocks to requests and serves prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tiers: KVTierConnector | None = None) -> None:
        if tiers is not None and not enable_prefix_caching:
            raise ValueError("KV tiers need prefix caching: blocks are found there by their prefix hashes")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = tiers
        self.pool = BlockPool(num_blocks)
        self._num_cached_blocks: dict[str, int] = {}  # per request: blocks already registered
        self.num_prefix_queries = 0  # tokens looked up / found, for the hit-rate metric
        self.num_prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int] | None:
        """Cached blocks matching the start of `req`'s tokens, and how many tokens they hold; None while the
        tiers read the rest of its prefix in the background (schedule it on a later step).

        Never the whole sequence: its last token must be computed to produce logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        req.update_block_hashes(self.block_size)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        # LoRA requests stay on the device: their hashes name an adapter, not its weights, and a shared tier
        # could hold another deployment's adapter under the same name.
        if self.tiers is not None and len(hits) < max_blocks and req.lora_name is None:
            rest = req.block_hashes[len(hits):max_blocks]
            if not self.tiers.stage(rest):
                return None
            hits += self._load_from_tiers(rest, hits)
        return hits, len(hits) * self.block_size

    def load_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """Make a prefix resident on the device as cached blocks, loading from the tiers what the device lacks
        (seeding a fresh replica); returns how many of its leading blocks are on the device now."""
        hits = []
        for h in block_hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        if self.tiers is not None and len(hits) < len(block_hashes):
            hits += self._load_from_tiers(block_hashes[len(hits):], hits)
        return len(hits)

    def _load_from_tiers(self, block_hashes: Sequence[BlockHash], device_hits: list[int]) -> list[int]:
        """Blocks that continue `device_hits` from the tiers, loaded into fresh device blocks, cached and free
        (like any prefix-cache hit, the caller's allocate_slots takes the reference)."""
        assert self.tiers is not None
        # Hold the device hits meanwhile: the fresh blocks come off the free queue, which holds them too.
        self.pool.touch(device_hits)
        try:
            room = self.pool.num_free
            fetched = self.tiers.fetch(block_hashes[:room]) if room else []
            if not fetched:
                return []
            block_ids = self.pool.allocate(len(fetched))
            try:
                self.tiers.load(fetched, block_ids)
            except Exception:  # a failed copy must not fail the request: recompute instead
                log.exception("loading %d KV blocks from the tiers failed; recomputing them", len(fetched))
                self.pool.release(block_ids)
                return []
            for b, h in zip(block_ids, block_hashes, strict=False):
                self.pool.cache(b, h)
            self.pool.release(reversed(block_ids))  # tail first, as `free` does: the head is evicted last
            return block_ids
        finally:
            self.pool.release(reversed(device_hits))

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix lookup (for the hit-rate metric)."""
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of KV (after any `computed_blocks` hits).

        Returns False, changing nothing, when the pool cannot hold them.
        """
        computed_blocks = computed_blocks or []
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        needed = self.blocks_needed(total) - len(req.block_ids) - len(computed_blocks)
        # Hit blocks nobody holds sit in the free queue: touching them uses up free blocks too.
        free_hits = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if max(needed, 0) > self.pool.num_free - free_hits:
            return False
        self.pool.touch(computed_blocks)
        req.block_ids.extend(computed_blocks)
        if needed > 0:
            req.block_ids.extend(self.pool.allocate(needed))
        return True

    def cache_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        req.update_block_hashes(self.block_size)
        done = self._num_cached_blocks.get(req.request_id)
        tiers = self.tiers if req.lora_name is None else None
        if done is None and tiers is not None:
            tiers.note_prefix(req.block_hashes[:req.num_prompt_tokens // self.block_size])
        done = done or 0
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(req.block_ids))
        new_ids, new_hashes = [], []
        for i in range(done, full):
            if self.pool.cache(req.block_ids[i], req.block_hashes[i]):
                new_ids.append(req.block_ids[i])
                new_hashes.append(req.block_hashes[i])
        self._num_cached_blocks[req.request_id] = max(done, full)
        if tiers is not None and new_ids:
            tiers.save(new_ids, new_hashes)

    def free(self, req: Request) -> None:
        """Return a request's blocks, tail first so that its shared head is evicted last."""
        self.pool.release(reversed(req.block_ids))
        req.block_ids = []
        self._num_cached_blocks.pop(req.request_id, None)

    def drain_events(self) -> KVEvents:
        """The events since the last drain. Safe from another thread than the engine's (a routing publisher):
        it takes only what was appended before it looked, each list slice and delete being atomic, and reads
        `removed` first, so a removal it takes never lacks the store that preceded it."""
        events = self.pool.events
        num_removed = len(events.removed)
        num_stored = len(events.stored)
        removed = events.removed[:num_removed]
        del events.removed[:num_removed]
        stored = events.stored[:num_stored]
        del events.stored[:num_stored]
        return KVEvents(stored, removed)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0
