"""In-process routing tables: the embedded default, for one gateway with its replicas on one machine.

Same semantics as the Redis backend (leases, lazy reaping, atomic reserve) under one lock.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from ember_platform.routing.records import (
    Balance,
    Candidate,
    DeploymentState,
    HeartbeatResult,
    NoReadyReplica,
    ReplicaRecord,
    ReplicasBusy,
    ReplicaState,
    ReplicaView,
    Reservation,
)
from ember_platform.routing.tables import (
    DEFAULT_HOLD_S,
    BlockTiers,
    RoutingTables,
    Slot,
    as_tiers,
    leading_tiers,
    pick,
    total_cost,
)


@dataclass(slots=True)
class _Entry:
    record: ReplicaRecord
    incarnation: str
    deadline: float
    blocks: dict[bytes, int] = field(default_factory=dict)  # hash -> tier rank
    held: dict[str, float] = field(default_factory=dict)  # reservation token -> deadline
    work: dict[str, float] = field(default_factory=dict)  # reservation token -> prompt tokens not yet prefilled


class InProcessTables(RoutingTables):
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._epoch = uuid.uuid4().hex
        self._replicas: dict[str, _Entry] = {}
        self._deployments: dict[str, DeploymentState] = {}
        self._shared: dict[str, set[bytes]] = {}  # shared store -> its blocks

    # --- the replica's side ---------------------------------------------------------------------

    def heartbeat(self, record: ReplicaRecord, *, incarnation: str, epoch: str | None,
                  ttl_s: float) -> HeartbeatResult:
        with self._lock:
            now = self._clock()
            self._reap(now)
            entry = self._replicas.get(record.replica_id)
            resync = entry is None or entry.incarnation != incarnation or epoch != self._epoch
            if entry is None or entry.incarnation != incarnation:
                held = entry.held if entry is not None else {}
                entry = self._replicas[record.replica_id] = _Entry(record, incarnation, now + ttl_s, held=held)
            elif resync:
                entry.blocks.clear()
            entry.record, entry.deadline = record, now + ttl_s
            return HeartbeatResult(self._epoch, resync)

    def update_blocks(self, replica_id: str, stored: BlockTiers, removed: Collection[bytes], *,
                      ttl_s: float) -> None:
        stored = as_tiers(stored)
        with self._lock:
            entry = self._replicas.get(replica_id)
            if entry is None:
                return  # lapsed or never registered: its next heartbeat asks for a resync anyway
            entry.blocks.update(stored)
            for h in removed:
                entry.blocks.pop(h, None)

    def replace_blocks(self, replica_id: str, hashes: BlockTiers, *, ttl_s: float) -> None:
        hashes = as_tiers(hashes)
        with self._lock:
            entry = self._replicas.get(replica_id)
            if entry is not None:
                entry.blocks = hashes

    def update_shared(self, store: str, stored: Collection[bytes], removed: Collection[bytes]) -> None:
        with self._lock:
            blocks = self._shared.setdefault(store, set())
            blocks.update(stored)
            blocks.difference_update(removed)

    def remove_replica(self, model: str, replica_id: str) -> None:
        with self._lock:
            self._replicas.pop(replica_id, None)

    # --- deployments ----------------------------------------------------------------------------

    def set_deployment_state(self, model: str, state: DeploymentState) -> None:
        with self._lock:
            self._deployments[model] = DeploymentState(state)

    def stored_deployment_state(self, model: str) -> DeploymentState | None:
        with self._lock:
            return self._deployments.get(model)

    # --- the gateway's side ---------------------------------------------------------------------

    def snapshot(self, model: str, block_hashes: Sequence[bytes] = ()) -> list[ReplicaView]:
        with self._lock:
            now = self._clock()
            self._reap(now)
            views = []
            for replica_id in sorted(self._replicas):
                entry = self._replicas[replica_id]
                if entry.record.model != model:
                    continue
                shared = self._shared.get(entry.record.shared_store, ()) if entry.record.shared_store else ()
                tiers = leading_tiers(block_hashes, entry.blocks, shared)
                views.append(ReplicaView(entry.record, self._in_flight(entry, now), len(tiers), tiers))
            return views

    def reserve(self, model: str, candidates: Sequence[Candidate], *, balance: Balance,
                hold_s: float = DEFAULT_HOLD_S, token: str | None = None) -> Reservation:
        token = token or uuid.uuid4().hex
        with self._lock:
            now = self._clock()
            self._reap(now)
            slots, entries = [], []
            for c in candidates:
                entry = self._replicas.get(c.replica_id)
                if entry is None or entry.record.model != model or entry.record.state != ReplicaState.READY:
                    continue
                slots.append(Slot(c, self._in_flight(entry, now), entry.record.load.capacity,
                                  entry.record.load.max_num_seqs, sum(entry.work.values())))
                entries.append(entry)
            if not slots:
                raise NoReadyReplica(f"no ready replica of '{model}' in the routing tables")
            chosen = pick(slots, balance)
            if chosen is None:
                raise ReplicasBusy(f"every ready replica of '{model}' is at capacity")
            entry, slot = entries[chosen], slots[chosen]
            entry.held[token] = now + hold_s
            if slot.candidate.work > 0:
                entry.work[token] = slot.candidate.work
            return Reservation(model, entry.record.replica_id, entry.record.url, token, slot.num_in_flight + 1,
                               total_cost(slot), 0, slot.candidate.work, _release=self._release,
                               _prefilled=self._prefilled)

    def _release(self, reservation: Reservation) -> None:
        with self._lock:
            entry = self._replicas.get(reservation.replica_id)
            if entry is not None:
                entry.held.pop(reservation.token, None)
                entry.work.pop(reservation.token, None)

    def _prefilled(self, reservation: Reservation) -> None:
        with self._lock:
            entry = self._replicas.get(reservation.replica_id)
            if entry is not None:
                entry.work.pop(reservation.token, None)

    def block_tiers(self, replica_id: str) -> dict[bytes, int]:
        with self._lock:
            entry = self._replicas.get(replica_id)
            return dict(entry.blocks) if entry is not None else {}

    def shared_blocks(self, store: str) -> set[bytes]:
        with self._lock:
            return set(self._shared.get(store, ()))

    # --- internals ------------------------------------------------------------------------------

    def _reap(self, now: float) -> None:
        for replica_id in [r for r, e in self._replicas.items() if e.deadline <= now]:
            del self._replicas[replica_id]

    @staticmethod
    def _in_flight(entry: _Entry, now: float) -> int:
        for token in [t for t, deadline in entry.held.items() if deadline <= now]:
            del entry.held[token]  # its holder died without releasing it
            entry.work.pop(token, None)
        return len(entry.held)

