"""The routing tables' interface, shared by the in-process and the Redis backend, and the selection rule.

Replicas write (heartbeat + load, KV block events, resident LoRA adapters); gateways read a snapshot of a
model's live replicas and then reserve a slot on one of them in one atomic step. A replica is live while its
lease (renewed by every heartbeat) has not lapsed; a lapsed one is dropped by the next reader.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ember_platform.routing.records import (
    DEVICE,
    KV_TIERS,
    SHARED,
    Balance,
    Candidate,
    DeploymentState,
    HeartbeatResult,
    ReplicaRecord,
    ReplicaState,
    ReplicaView,
    Reservation,
)

DEFAULT_HOLD_S = 600.0  # a reservation whose holder died frees itself after this long (a request's timeout)
SHARED_TTL_S = 24 * 3600.0  # a shared store's block set outlives any replica, but not a day without news

# Block hashes with the rank (index in KV_TIERS) of the fastest tier holding each, or plain hashes: on the device.
BlockTiers = Mapping[bytes, int] | Collection[bytes]


def as_tiers(blocks: BlockTiers) -> dict[bytes, int]:
    """{hash: tier rank} from either form of BlockTiers; ranks are checked, since routing trusts them."""
    if not isinstance(blocks, Mapping):
        return dict.fromkeys(blocks, DEVICE)
    for rank in blocks.values():
        if not 0 <= rank < len(KV_TIERS):
            raise ValueError(f"tier rank must be in [0, {len(KV_TIERS)}) (one of {KV_TIERS}), got {rank}")
    return dict(blocks)


class RoutingTables(ABC):
    """Replicas, their KV blocks, loads and adapters, deployment states, and slot reservations."""

    # --- the replica's side ---------------------------------------------------------------------

    @abstractmethod
    def heartbeat(self, record: ReplicaRecord, *, incarnation: str, epoch: str | None,
                  ttl_s: float) -> HeartbeatResult:
        """Renew the replica's lease for `ttl_s` and store its record.

        `incarnation` is unique to one publisher (one replica process) and `epoch` is what the previous heartbeat
        returned (None the first time). `resync` comes back True when the tables cannot be trusted to hold this
        replica's blocks: the first heartbeat, a new incarnation, a lapsed lease, or a store that lost its
        contents (a new epoch). The publisher must then `replace_blocks` with everything it holds.
        """

    @abstractmethod
    def update_blocks(self, replica_id: str, stored: BlockTiers, removed: Collection[bytes], *,
                      ttl_s: float) -> None:
        """Apply a batch of KV events: block hashes the replica now holds (with the rank of the fastest of its own
        tiers that holds each; a hash already present takes the new rank) and ones it no longer holds at all."""

    @abstractmethod
    def replace_blocks(self, replica_id: str, hashes: BlockTiers, *, ttl_s: float) -> None:
        """Replace the replica's whole block set at once (the resync)."""

    @abstractmethod
    def update_shared(self, store: str, stored: Collection[bytes], removed: Collection[bytes]) -> None:
        """Blocks that entered and left a shared store (S3), named as replicas name it in `shared_store`.

        Not leased to a replica: the blocks stay in the store when their writer dies. The set expires a day after
        its last change, and a Redis restart empties it until the replicas' resyncs refill it.
        """

    @abstractmethod
    def remove_replica(self, model: str, replica_id: str) -> None:
        """Forget a replica now (it is shutting down) rather than when its lease lapses."""

    # --- deployments ----------------------------------------------------------------------------

    @abstractmethod
    def set_deployment_state(self, model: str, state: DeploymentState) -> None: ...

    @abstractmethod
    def stored_deployment_state(self, model: str) -> DeploymentState | None: ...

    def deployment_state(self, model: str) -> DeploymentState:
        """The state the control plane last set; if none is stored (e.g. Redis restarted), what the replicas say."""
        stored = self.stored_deployment_state(model)
        if stored is not None:
            return stored
        ready = any(v.record.state == ReplicaState.READY for v in self.snapshot(model))
        return DeploymentState.WARM if ready else DeploymentState.COLD

    # --- the gateway's side ---------------------------------------------------------------------

    @abstractmethod
    def snapshot(self, model: str, block_hashes: Sequence[bytes] = ()) -> list[ReplicaView]:
        """The model's live replicas (any state), each with the leading run of `block_hashes` it can reuse and the
        tier each of those blocks would come from: its own fastest, else its shared store's.

        Sorted by replica id, so that both backends break ties the same way.
        """

    @abstractmethod
    def reserve(self, model: str, candidates: Sequence[Candidate], *, balance: Balance,
                hold_s: float = DEFAULT_HOLD_S, token: str | None = None) -> Reservation:
        """Atomically pick the best eligible candidate (see `pick`) and take one of its slots.

        Raises NoReadyReplica when no candidate is live and ready, ReplicasBusy when all are at capacity.
        """

    @abstractmethod
    def block_tiers(self, replica_id: str) -> dict[bytes, int]:
        """The replica's blocks with their tier ranks as stored (for inspection and tests; routers use `snapshot`)."""

    def blocks(self, replica_id: str) -> set[bytes]:
        """The replica's block hashes, whatever tier holds them."""
        return set(self.block_tiers(replica_id))

    @abstractmethod
    def shared_blocks(self, store: str) -> set[bytes]:
        """A shared store's blocks as stored."""

    def close(self) -> None:  # noqa: B027 - optional for backends without connections
        """Release connections; the tables' contents stay."""


def leading_tiers(block_hashes: Sequence[bytes], own: Mapping[bytes, int],
                  shared: Collection[bytes]) -> tuple[int, ...]:
    """The tier rank of each block in the leading run of `block_hashes` that a replica can reuse: from its own
    tiers (`own`), else from its shared store. Hashes chain, so the run ends at the first block it lacks."""
    ranks = []
    for h in block_hashes:
        rank = own.get(h)
        if rank is None:
            if h not in shared:
                break
            rank = SHARED
        ranks.append(rank)
    return tuple(ranks)


# --- the selection rule ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Slot:
    """A live, ready candidate as the reservation sees it, its in-flight count read at that moment."""

    candidate: Candidate
    num_in_flight: int
    capacity: int
    max_num_seqs: int
    pending_prefill: float = 0.0  # prompt tokens reserved requests have yet to prefill there


def total_cost(slot: Slot) -> float:
    c = slot.candidate
    queued = max(0, slot.num_in_flight + 1 - slot.max_num_seqs)  # would this request wait for a batch slot?
    return c.cost + c.per_request * slot.num_in_flight + c.per_queued * queued + c.per_pending * slot.pending_prefill


def pick(slots: Sequence[Slot], balance: Balance) -> int | None:
    """Index of the slot to take, or None when every one is at capacity (or `slots` is empty).

    The reference for the Redis backend's Lua script, which must decide identically: refuse full replicas and
    ones beyond the imbalance bound, then take the lowest total cost; ties go to the less loaded, then the
    earlier candidate.
    """
    if not slots:
        return None
    least = min(s.num_in_flight for s in slots)
    best: int | None = None
    best_key: tuple[float, int] = (0.0, 0)
    for i, s in enumerate(slots):
        if s.num_in_flight >= s.capacity:
            continue
        if s.num_in_flight - least > balance.abs_threshold and s.num_in_flight > balance.rel_threshold * least:
            continue
        key = (total_cost(s), s.num_in_flight)
        if best is None or key < best_key:
            best, best_key = i, key
    return best


def open_tables(redis_url: str | None = None, *, namespace: str | None = None) -> RoutingTables:
    """Redis tables for `--redis-url URL` (redis-py is imported only then), the in-process ones without it."""
    if redis_url:
        from ember_platform.routing.redis_tables import DEFAULT_NAMESPACE, RedisTables
        return RedisTables.from_url(redis_url, namespace=namespace or DEFAULT_NAMESPACE)
    from ember_platform.routing.memory import InProcessTables
    return InProcessTables()
