"""What the routing tables hold: replica records and loads, deployment states, reservations.

Plain data, shared by both table backends, the router, the publisher and the scorer plugins.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ember.errors import EmberError


class DeploymentState(StrEnum):
    COLD = "cold"          # no replica, nothing loaded
    STARTING = "starting"  # a replica is loading
    WARM = "warm"          # at least one replica serves
    SLEEPING = "sleeping"  # weights parked in host RAM, engine memory freed: wakes faster than cold


# Where a replica can reuse a KV block from, fastest first; a block's *tier rank* is its index here. "device" is
# the engine's prefix cache; "cpu" and "disk" are the replica's own lower tiers; "s3" is a store that every
# replica configured with it shares (ember_platform.kvtiers).
KV_TIERS = ("device", "cpu", "disk", "s3")
DEVICE, SHARED = 0, KV_TIERS.index("s3")


class ReplicaState(StrEnum):
    """A replica's lifecycle as it publishes it; only READY replicas are routed to."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load, as its engine last reported it."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    max_num_seqs: int = 1
    # Requests the replica takes at once, running + queued in its engine. Routers refuse it beyond that, so a
    # burst waits at the gateway (where it can still go to whichever replica frees up first) instead of queueing.
    capacity: int = 0  # 0: max_num_seqs

    def __post_init__(self) -> None:
        for name in ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "capacity"):
            if getattr(self, name) < 0:
                raise ValueError(f"ReplicaLoad.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"ReplicaLoad.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.capacity == 0:
            object.__setattr__(self, "capacity", self.max_num_seqs)


@dataclass(frozen=True, slots=True)
class KVFetchCosts:
    """What reusing a block from a lower tier costs this replica, as it measured it, so that a router can price a
    fetch (block bytes over the tier's read bandwidth) against recomputing (block tokens over the prefill rate).
    Zeros and missing tiers mean "not measured yet"; scorers then fall back to their defaults."""

    block_bytes: int = 0
    prefill_tokens_per_s: float = 0.0
    read_bandwidth: tuple[tuple[str, float], ...] = ()  # (tier, bytes/s)

    @classmethod
    def of(cls, block_bytes: int = 0, prefill_tokens_per_s: float = 0.0,
           read_bandwidth: Mapping[str, float] | None = None) -> KVFetchCosts:
        return cls(int(block_bytes), float(prefill_tokens_per_s),
                   tuple(sorted((str(t), float(b)) for t, b in (read_bandwidth or {}).items() if b > 0)))

    def fetch_seconds(self, tier: str) -> float | None:
        """Seconds to read one block from `tier`, or None if not measured."""
        bandwidth = dict(self.read_bandwidth).get(tier)
        if not bandwidth or not self.block_bytes:
            return None
        return self.block_bytes / bandwidth

    def to_json(self) -> str:
        return json.dumps({"block_bytes": self.block_bytes, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                           "read_bandwidth": dict(self.read_bandwidth)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVFetchCosts:
        data = json.loads(text) if text else {}
        return cls.of(data.get("block_bytes", 0), data.get("prefill_tokens_per_s", 0.0), data.get("read_bandwidth"))


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """What a replica publishes with each heartbeat (its KV blocks travel separately, as events)."""

    replica_id: str
    model: str
    url: str
    version: str = ""
    state: ReplicaState = ReplicaState.READY
    block_size: int = 16
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    adapters: frozenset[str] = frozenset()  # LoRA adapters resident in its engine
    kv_costs: KVFetchCosts = field(default_factory=KVFetchCosts)
    # The shared KV store (S3 bucket, prefix and model layout) it reads blocks from, "" for none: blocks any
    # replica uploaded there are reusable by this one too.
    shared_store: str = ""

    def __post_init__(self) -> None:
        if not self.replica_id or any(c in self.replica_id for c in " \n\x00"):
            raise ValueError(f"replica_id must be non-empty without spaces or NULs, got {self.replica_id!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        object.__setattr__(self, "state", ReplicaState(self.state))
        object.__setattr__(self, "adapters", frozenset(self.adapters))


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One live replica as a router sees it for one request."""

    record: ReplicaRecord
    num_in_flight: int      # requests gateways have reserved on it (re-read atomically when reserving)
    num_cached_blocks: int  # leading blocks of the request's hash chain this replica can reuse, from any tier
    # The tier rank (index in KV_TIERS) each of those blocks is reused from; empty means all from the device.
    cached_tiers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.cached_tiers:
            object.__setattr__(self, "cached_tiers", (DEVICE,) * self.num_cached_blocks)
        elif len(self.cached_tiers) != self.num_cached_blocks:
            raise ValueError(f"cached_tiers has {len(self.cached_tiers)} entries for {self.num_cached_blocks} blocks")

    @property
    def num_device_blocks(self) -> int:
        """Leading blocks already in device memory (the rest of the cached run must be fetched into new blocks)."""
        for i, rank in enumerate(self.cached_tiers):
            if rank != DEVICE:
                return i
        return self.num_cached_blocks

    @property
    def replica_id(self) -> str:
        return self.record.replica_id

    @property
    def load(self) -> ReplicaLoad:
        return self.record.load


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica offered to the atomic reservation, with its cost split into a fixed part and load-linear parts.

    The tables add `per_request * in_flight + per_queued * max(0, in_flight + 1 - max_num_seqs) + per_pending *
    pending_prefill`, all read at reservation time, so the load part of the cost is never stale. `pending_prefill`
    is the prompt tokens the replica has yet to prefill for requests already reserved on it (each counted until
    its first token), and `work` is what this request would add to it there.
    """

    replica_id: str
    cost: float = 0.0
    per_request: float = 0.0
    per_queued: float = 0.0
    per_pending: float = 0.0
    work: float = 0.0


@dataclass(frozen=True, slots=True)
class Balance:
    """The imbalance bound: a replica whose in-flight count exceeds the least loaded live replica's by more than
    `abs_threshold` requests AND by more than `rel_threshold` times is not eligible, whatever its cache holds
    (SGLang's cache-aware router's balance thresholds). The least loaded replica is therefore always eligible.
    """

    abs_threshold: int = 8
    rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.abs_threshold < 0 or self.rel_threshold < 1.0:
            raise ValueError(f"Balance needs abs_threshold >= 0 and rel_threshold >= 1, got {self}")


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    epoch: str    # the tables' generation; a new one after the store lost its contents
    resync: bool  # the tables do not hold this replica's block set: send all of it


@dataclass(slots=True)
class Reservation:
    """A slot on a replica, held until `release()` (or until `hold_s` passes, should its holder die)."""

    model: str
    replica_id: str
    url: str
    token: str
    num_in_flight: int       # on that replica, this reservation included
    cost: float
    num_cached_blocks: int
    pending_work: float = 0.0  # prompt tokens counted as pending prefill on the replica until `prefilled()`
    _release: Callable[[Reservation], None] | None = field(default=None, repr=False)
    _prefilled: Callable[[Reservation], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the slot back; calling it again does nothing."""
        self._prefilled = None  # releasing clears the pending prefill too
        release, self._release = self._release, None
        if release is not None:
            release(self)

    def prefilled(self) -> None:
        """The request's first token arrived: its prompt no longer delays others on the replica (idempotent)."""
        prefilled, self._prefilled = self._prefilled, None
        if prefilled is not None and self._release is not None and self.pending_work:
            prefilled(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class RoutingError(EmberError):
    """No replica can take a request now. `retry_after` (seconds) says when trying again makes sense."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NoReadyReplica(RoutingError):
    """The model has no live, ready replica in the tables (cold, starting, or every lease lapsed)."""


class ReplicasBusy(RoutingError):
    """Every ready replica of the model is at capacity."""


class TablesUnavailable(RoutingError):
    """The routing tables' store (Redis) cannot be reached."""
