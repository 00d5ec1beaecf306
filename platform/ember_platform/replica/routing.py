"""A replica's side of the shared routing tables (`--redis-url`): heartbeats with its engine's load, the KV blocks it
can reuse (its prefix cache, and with KV tiers on its CPU and disk tiers) and its resident LoRA adapters, so that
any gateway can route to it by prefix and load.

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

from ember_platform.routing import ReplicaPublisher, ReplicaState, engine_load, open_tables

if TYPE_CHECKING:
    from ember_platform.engine.engine import LLMEngine

log = logging.getLogger("ember.replica.routing")

REPLICA_ID_ENV = "EMBER_REPLICA_ID"


class RoutingPresence:
    """Publishes one loaded replica to the routing tables until `close()`."""

    # Tiers whose blocks this replica reuses at a fraction of recomputing them (bench_kv_tiers: CPU 24x, disk 17x
    # faster), published as blocks it holds. S3 is shared by every replica, so it favours none of them.
    PUBLISHED_TIERS = ("device", "cpu", "disk")

    def __init__(self, redis_url: str, engine: LLMEngine, *, url: str, model: str, version: str,
                 poll_s: float = 0.05) -> None:
        self.replica_id = os.environ.get(REPLICA_ID_ENV) or uuid.uuid4().hex[:8]
        self.engine = engine
        self.publisher = ReplicaPublisher(open_tables(redis_url), replica_id=self.replica_id, model=model, url=url,
                                          version=version, block_size=engine.block_size, load=engine_load(engine),
                                          state=ReplicaState.READY)
        self.poll_s = poll_s
        self._held: dict[bytes, set[str]] = {}  # block hash -> the published tiers holding it
        self._held_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._forward_kv_events, name="ember-kv-events", daemon=True)

    def start(self) -> RoutingPresence:
        self.engine.add_lora_listener(self.publisher.set_adapters)
        if self.engine.kv_tiers is not None:
            self.engine.kv_tiers.add_listener(lambda event: self.tier_changed(event.tier, event.stored, event.removed))
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

    def tier_changed(self, tier: str, stored: list[bytes], removed: list[bytes]) -> None:
        """A tier gained or lost blocks: publish a block while any published tier holds it (a block evicted from
        the device but kept in the CPU tier still makes this replica the cheap one for its prefix)."""
        if tier not in self.PUBLISHED_TIERS:
            return
        entered, left = [], []
        with self._held_lock:
            for h in stored:
                tiers = self._held.setdefault(h, set())
                if not tiers:
                    entered.append(h)
                tiers.add(tier)
            for h in removed:
                tiers = self._held.get(h)
                if tiers is None:
                    continue
                tiers.discard(tier)
                if not tiers:
                    del self._held[h]
                    left.append(h)
        if entered or left:
            self.publisher.record_kv_events(entered, left)

    def _forward_kv_events(self) -> None:
        while not self._stop.wait(self.poll_s):
            events = self.engine.kv.drain_events()
            if events.stored or events.removed:
                self.tier_changed("device", events.stored, events.removed)
