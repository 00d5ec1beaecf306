"""A replica's side of the shared routing tables (`--redis-url`): heartbeats with its engine's load, the KV blocks it
can reuse (its prefix cache, and with KV tiers on, its CPU and disk tiers, each block with the rank of the fastest
tier holding it, and its uploads to a shared S3 store), what fetching from each tier costs it as measured, and its
resident LoRA adapters, so that any gateway can route to it by prefix, tier and load.

The replica id comes from `EMBER_REPLICA_ID` (the control plane's id for it, so both name it alike) or is made
up. KV events are taken from the engine (`kv.drain_events()`, safe off the engine thread) every `poll_s` by a
small thread: the engine's step loop never waits on Redis.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import TYPE_CHECKING

from ember_platform.routing import KV_TIERS, KVFetchCosts, ReplicaPublisher, ReplicaState, engine_load, open_tables

if TYPE_CHECKING:
    from ember_platform.engine.engine import LLMEngine

log = logging.getLogger("ember.replica.routing")

REPLICA_ID_ENV = "EMBER_REPLICA_ID"


class RoutingPresence:
    """Publishes one loaded replica to the routing tables until `close()`."""

    # The replica's own tiers, fastest first: a block is published with the rank of the fastest one holding it.
    # S3 is shared by every replica configured with the same store, so its blocks go to the store's shared set.
    OWN_TIERS = ("device", "cpu", "disk")

    def __init__(self, redis_url: str, engine: LLMEngine, *, url: str, model: str, version: str,
                 poll_s: float = 0.05) -> None:
        self.replica_id = os.environ.get(REPLICA_ID_ENV) or uuid.uuid4().hex[:8]
        self.engine = engine
        tiers = engine.kv_tiers
        self.publisher = ReplicaPublisher(open_tables(redis_url), replica_id=self.replica_id, model=model, url=url,
                                          version=version, block_size=engine.block_size, load=engine_load(engine),
                                          state=ReplicaState.READY, kv_costs=self.kv_costs,
                                          shared_store=tiers.shared_store if tiers is not None else "")
        self.poll_s = poll_s
        self._held: dict[bytes, set[str]] = {}  # block hash -> the published tiers holding it
        self._held_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._forward_kv_events, name="ember-kv-events", daemon=True)

    def start(self) -> RoutingPresence:
        self.engine.add_lora_listener(self.publisher.set_adapters)
        tiers = self.engine.kv_tiers
        if tiers is not None:
            tiers.add_listener(lambda event: self.tier_changed(event.tier, event.stored, event.removed))
            for tier, hashes in tiers.membership().items():  # e.g. a disk tier that outlived the last process
                self.tier_changed(tier, hashes, [])
        self.publisher.set_adapters(self.engine.loaded_loras)
        self.publisher.start()
        self._thread.start()
        log.info("publishing replica %s to the routing tables", self.replica_id)
        return self

    def draining(self) -> None:
        """Gateways stop choosing it at once (its lease would take seconds to lapse)."""
        self.publisher.set_state(ReplicaState.DRAINING)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.publisher.close()

    def kv_costs(self) -> KVFetchCosts:
        """Block bytes, the tiers' measured read bandwidths and the engine's measured prefill rate."""
        tiers = self.engine.kv_tiers
        if tiers is None:
            return KVFetchCosts()
        return KVFetchCosts.of(tiers.layout.block_bytes, self.engine.prefill_tokens_per_s, tiers.read_bandwidth())

    def tier_changed(self, tier: str, stored: list[bytes], removed: list[bytes]) -> None:
        """A tier gained or lost blocks: publish each affected block with the rank of the fastest of this replica's
        tiers that still holds it (a block evicted from the device but kept in the CPU tier still makes this
        replica a cheap one for its prefix, at the price of a CPU fetch)."""
        if tier == "s3":
            self.publisher.record_shared(stored, removed)
            return
        if tier not in self.OWN_TIERS:
            return
        changes: dict[bytes, int | None] = {}
        with self._held_lock:
            for h in stored:
                tiers = self._held.setdefault(h, set())
                before = _fastest(tiers)
                tiers.add(tier)
                if _fastest(tiers) != before:
                    changes[h] = _fastest(tiers)
            for h in removed:
                tiers = self._held.get(h)
                if tiers is None or tier not in tiers:
                    continue
                before = _fastest(tiers)
                tiers.discard(tier)
                if not tiers:
                    del self._held[h]
                if _fastest(tiers) != before:
                    changes[h] = _fastest(tiers)
            if changes:  # under the lock: two threads' changes to one block must reach the publisher in order
                self.publisher.record_block_tiers(changes)

    def _forward_kv_events(self) -> None:
        while not self._stop.wait(self.poll_s):
            events = self.engine.kv.drain_events()
            if events.stored or events.removed:
                self.tier_changed("device", events.stored, events.removed)


def _fastest(tiers: set[str]) -> int | None:
    """The rank (index in KV_TIERS) of the fastest tier in `tiers`, None if empty."""
    return min((KV_TIERS.index(t) for t in tiers), default=None)
