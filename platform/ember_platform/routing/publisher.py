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
from collections.abc import Callable, Iterable
from typing import Any

from ember_platform.routing.records import (
    HeartbeatResult,
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
    batches every `flush_s`, and a heartbeat every `heartbeat_s` that keeps a lease of `ttl_s`.
    """

    def __init__(self, tables: RoutingTables, *, replica_id: str, model: str, url: str,
                 load: Callable[[], ReplicaLoad], version: str = "", block_size: int = 16,
                 state: ReplicaState = ReplicaState.STARTING, heartbeat_s: float = 1.0, ttl_s: float | None = None,
                 flush_s: float = 0.05) -> None:
        self.tables = tables
        self.replica_id = replica_id
        self.model = model
        self.url = url
        self.version = version
        self.block_size = block_size
        self.load = load
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s if ttl_s is not None else 3 * heartbeat_s  # two heartbeats may be late or lost
        self.flush_s = flush_s
        self.incarnation = uuid.uuid4().hex  # tells the tables that a restarted process is not its predecessor
        self.num_resyncs = 0
        self._state = ReplicaState(state)
        self._adapters: frozenset[str] = frozenset()
        self._lock = threading.Lock()      # guards the block set and the pending batch
        self._io = threading.Lock()        # one conversation with the tables at a time
        self._blocks: set[bytes] = set()
        self._pending: dict[bytes, bool] = {}  # hash -> present: only a hash's last state needs sending
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
                    self._set(h, present)
            for h in stored:
                if h not in both:
                    self._set(h, True)
            for h in removed:
                if h not in both:
                    self._set(h, False)

    def _set(self, block_hash: bytes, present: bool) -> None:
        if present:
            self._blocks.add(block_hash)
        else:
            self._blocks.discard(block_hash)
        self._pending[block_hash] = present

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
                             block_size=self.block_size, load=self.load(), adapters=self._adapters)

    def publish(self) -> HeartbeatResult:
        """One heartbeat, then a resync or the pending events. Raises TablesUnavailable if the store is down."""
        with self._io:
            try:
                result = self.tables.heartbeat(self.record(), incarnation=self.incarnation, epoch=self._epoch,
                                               ttl_s=self.ttl_s)
                self._epoch = result.epoch
                if result.resync or not self._in_sync:
                    with self._lock:  # events recorded from here on go to the next batch, after the full set
                        everything = list(self._blocks)
                        self._pending.clear()
                    self.tables.replace_blocks(self.replica_id, everything, ttl_s=self.ttl_s)
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
            if not self._pending:
                return
            batch, self._pending = self._pending, {}
        stored = [h for h, present in batch.items() if present]
        removed = [h for h, present in batch.items() if not present]
        self.tables.update_blocks(self.replica_id, stored, removed, ttl_s=self.ttl_s)

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
