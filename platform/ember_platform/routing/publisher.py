"""What a replica runs to keep the routing tables current: heartbeats with its load, batched KV block events,
its resident LoRA adapters, and a full resync of its block set whenever the tables ask for one.

The publisher keeps its own copy of the replica's block set, built from the same events it forwards. That copy
is what a resync sends, so the engine is never read from another thread, and a batch lost with a connection
costs nothing: the publisher marks itself out of sync and the next heartbeat that gets through resends it all.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ember_platform.routing.records import (
    DEVICE,
    HeartbeatResult,
    KVFetchCosts,
    ReplicaLoad,
    ReplicaRecord,
    ReplicaState,
    TablesUnavailable,
)
from ember_platform.routing.tables import RoutingTables

log = logging.getLogger("ember.routing")


class ReplicaPublisher:
    """Publishes one replica to the routing tables from a background thread (`start()` ... `close()`).

    `record_kv_events` is safe to call from the engine's thread after each step; the thread sends the events in
    batches every `flush_s`, and a heartbeat every `heartbeat_s` that keeps a lease of `ttl_s`. With KV tiers, a
    block's tier rank (`record_block_tiers`) and the replica's uploads to a shared store (`record_shared`, with
    `shared_store` naming it) travel the same way, and `kv_costs` prices fetching from each tier.
    """

    def __init__(self, tables: RoutingTables, *, replica_id: str, model: str, url: str,
                 load: Callable[[], ReplicaLoad], version: str = "", block_size: int = 16,
                 state: ReplicaState = ReplicaState.STARTING, heartbeat_s: float = 1.0, ttl_s: float | None = None,
                 flush_s: float = 0.05, kv_costs: Callable[[], KVFetchCosts] | None = None,
                 shared_store: str = "") -> None:
        self.tables = tables
        self.replica_id = replica_id
        self.model = model
        self.url = url
        self.version = version
        self.block_size = block_size
        self.load = load
        self.kv_costs = kv_costs
        self.shared_store = shared_store
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s if ttl_s is not None else 3 * heartbeat_s  # two heartbeats may be late or lost
        self.flush_s = flush_s
        self.incarnation = uuid.uuid4().hex  # tells the tables that a restarted process is not its predecessor
        self.num_resyncs = 0
        self._state = ReplicaState(state)
        self._adapters: frozenset[str] = frozenset()
        self._lock = threading.Lock()      # guards the block set and the pending batch
        self._io = threading.Lock()        # one conversation with the tables at a time
        self._blocks: dict[bytes, int] = {}  # hash -> tier rank
        self._pending: dict[bytes, int | None] = {}  # hash -> rank, None: gone. Only its last state needs sending
        self._shared: set[bytes] = set()  # this replica's uploads to the shared store
        self._shared_pending: dict[bytes, bool] = {}
        self._epoch: str | None = None
        self._in_sync = False
        self._beat_now = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- what the replica tells it ------------------------------------------------------------

    def record_kv_events(self, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Blocks that entered and left the prefix cache since the last call (the engine's `drain_events()`).

        The two lists lose the order between them; a hash cannot be cached twice at once, so its events
        alternate, and the counts tell where it ended up.
        """
        stored, removed = list(stored), list(removed)
        with self._lock:
            both = set(stored).intersection(removed)
            if both:
                counts = Counter(stored)
                counts.subtract(removed)
                for h in both:
                    present = counts[h] > 0 if counts[h] else h in self._blocks
                    self._set(h, DEVICE if present else None)
            for h in stored:
                if h not in both:
                    self._set(h, DEVICE)
            for h in removed:
                if h not in both:
                    self._set(h, None)

    def record_block_tiers(self, changes: Mapping[bytes, int | None]) -> None:
        """Blocks whose fastest tier on this replica changed: its new rank, or None when no tier holds it."""
        with self._lock:
            for h, rank in changes.items():
                self._set(h, rank)

    def record_shared(self, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Blocks this replica uploaded to (or deleted from) the shared store."""
        with self._lock:
            for h in stored:
                self._shared.add(h)
                self._shared_pending[h] = True
            for h in removed:
                self._shared.discard(h)
                self._shared_pending[h] = False

    def _set(self, block_hash: bytes, rank: int | None) -> None:
        if rank is None:
            self._blocks.pop(block_hash, None)
        else:
            self._blocks[block_hash] = rank
        self._pending[block_hash] = rank

    def set_state(self, state: ReplicaState) -> None:
        """READY once it takes requests, DRAINING before it stops: published at once, not at the next beat."""
        self._state = ReplicaState(state)
        self._beat_now.set()

    def set_adapters(self, adapters: Iterable[str]) -> None:
        """The LoRA adapters now resident in the engine."""
        self._adapters = frozenset(adapters)
        self._beat_now.set()

    @property
    def blocks(self) -> frozenset[bytes]:
        with self._lock:
            return frozenset(self._blocks)

    @property
    def in_sync(self) -> bool:
        return self._in_sync

    # --- talking to the tables ----------------------------------------------------------------

    def record(self) -> ReplicaRecord:
        return ReplicaRecord(self.replica_id, self.model, self.url, version=self.version, state=self._state,
                             block_size=self.block_size, load=self.load(), adapters=self._adapters,
                             kv_costs=self.kv_costs() if self.kv_costs else KVFetchCosts(),
                             shared_store=self.shared_store)

    def publish(self) -> HeartbeatResult:
        """One heartbeat, then a resync or the pending events. Raises TablesUnavailable if the store is down."""
        with self._io:
            try:
                result = self.tables.heartbeat(self.record(), incarnation=self.incarnation, epoch=self._epoch,
                                               ttl_s=self.ttl_s)
                self._epoch = result.epoch
                if result.resync or not self._in_sync:
                    with self._lock:  # events recorded from here on go to the next batch, after the full set
                        everything = dict(self._blocks)
                        uploads = list(self._shared)
                        self._pending.clear()
                        self._shared_pending.clear()
                    self.tables.replace_blocks(self.replica_id, everything, ttl_s=self.ttl_s)
                    if self.shared_store and uploads:  # others' uploads are theirs to resend
                        self.tables.update_shared(self.shared_store, uploads, ())
                    self.num_resyncs += 1
                    self._in_sync = True
                else:
                    self._flush()
                return result
            except Exception:
                self._in_sync = False
                raise

    def flush(self) -> None:
        """Send the pending block events now (a no-op while out of sync: the next heartbeat resends all)."""
        with self._io:
            if not self._in_sync:
                return
            try:
                self._flush()
            except Exception:
                self._in_sync = False
                raise

    def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, {}
            shared, self._shared_pending = self._shared_pending, {}
        if batch:
            stored = {h: rank for h, rank in batch.items() if rank is not None}
            removed = [h for h, rank in batch.items() if rank is None]
            self.tables.update_blocks(self.replica_id, stored, removed, ttl_s=self.ttl_s)
        if shared and self.shared_store:
            self.tables.update_shared(self.shared_store, [h for h, up in shared.items() if up],
                                      [h for h, up in shared.items() if not up])

    # --- the background thread ----------------------------------------------------------------

    def start(self) -> ReplicaPublisher:
        self._thread = threading.Thread(target=self._run, name=f"ember-publisher-{self.replica_id}", daemon=True)
        self._thread.start()
        return self

    def close(self, *, deregister: bool = True) -> None:
        """Stop the thread; with `deregister`, leave the tables now rather than when the lease lapses."""
        self._stop.set()
        self._beat_now.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.heartbeat_s * 2))
        if deregister:
            try:
                self.tables.remove_replica(self.model, self.replica_id)
            except TablesUnavailable as e:
                log.warning("replica %s could not leave the routing tables (its lease will lapse): %s",
                            self.replica_id, e)

    def _run(self) -> None:
        next_beat = 0.0
        failing = False
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_beat or self._beat_now.is_set():
                    self._beat_now.clear()
                    next_beat = now + self.heartbeat_s
                    self.publish()
                    if failing:
                        log.info("replica %s: routing tables reachable again; block set resent", self.replica_id)
                    failing = False
                elif self._in_sync:
                    self.flush()
            except TablesUnavailable as e:
                if not failing:  # once per outage, not once per beat
                    log.warning("replica %s: %s; retrying every %.1f s", self.replica_id, e, self.heartbeat_s)
                failing = True
            except Exception:
                log.exception("replica %s: publishing to the routing tables failed", self.replica_id)
            timeout = max(0.0, next_beat - time.monotonic())
            if self._in_sync:
                timeout = min(timeout, self.flush_s)
            self._beat_now.wait(timeout)


def engine_load(engine: Any, *, capacity: int = 0) -> Callable[[], ReplicaLoad]:
    """A `load` callable over an LLMEngine: plain reads of counters, safe from the publisher's thread."""

    def load() -> ReplicaLoad:
        scheduler, kv = engine.scheduler, engine.kv
        return ReplicaLoad(num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
                           num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_blocks,
                           max_num_seqs=scheduler.max_num_seqs, capacity=capacity)

    return load
