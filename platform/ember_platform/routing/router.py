"""The router: rates a model's ready replicas for one request and reserves a slot on the best one.

Two round trips to the tables: a snapshot (live replicas, each with the length of the request's cached prefix),
then the atomic reservation, which re-reads loads, applies the imbalance bound and capacity, and takes the slot.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember_platform.engine.block_hash import extra_keys, hash_blocks
from ember_platform.routing.records import (
    Balance,
    Candidate,
    NoReadyReplica,
    ReplicaState,
    ReplicaView,
    Reservation,
)
from ember_platform.routing.scoring import RouterConfig, RouteRequest, Score, WeightedScorer, load_scorers
from ember_platform.routing.tables import DEFAULT_HOLD_S, RoutingTables

if TYPE_CHECKING:
    from ember.plugins import PluginHost


def request_block_hashes(token_ids: Sequence[int], block_size: int, *, lora: str | None = None,
                         salt: str | None = None) -> tuple[bytes, ...]:
    """A prompt's full-block hashes exactly as the engine computes them (adapter and cache salt included)."""
    return tuple(hash_blocks(token_ids, block_size, extra_keys(lora, salt)))


def uncached_tokens(request: RouteRequest, view: ReplicaView) -> int:
    """The prompt tokens `view`'s replica would prefill for `request`: its pending work there until the first token."""
    block_size = view.record.block_size
    return max(0, request.prompt_tokens(block_size) - view.num_cached_blocks * block_size)


@dataclass(frozen=True, slots=True)
class Rated:
    """A replica with its weighted score and each scorer's share (for explaining a decision)."""

    view: ReplicaView
    score: Score
    parts: dict[str, Score]


class Router:
    def __init__(self, tables: RoutingTables, scorers: Sequence[WeightedScorer], *, balance: Balance | None = None,
                 hold_s: float = DEFAULT_HOLD_S) -> None:
        self.tables = tables
        self.scorers = list(scorers)
        self.balance = balance or Balance()
        self.hold_s = hold_s
        self._turns = itertools.count()

    @classmethod
    def from_config(cls, tables: RoutingTables, config: RouterConfig | None = None, *,
                    host: PluginHost | None = None) -> Router:
        """Scorers from the installed plugins (`ember_routing_scorers`), weighted as `config` says."""
        config = config or RouterConfig.from_env()
        return cls(tables, load_scorers(config, host), balance=config.balance, hold_s=config.hold_s)

    def rate(self, request: RouteRequest, views: Sequence[ReplicaView]) -> list[Rated]:
        """Every scorer's weighted score for each replica, summed."""
        totals = [Score() for _ in views]
        parts: list[dict[str, Score]] = [{} for _ in views]
        for ws in self.scorers:
            scores = list(ws.scorer.score(request, views))
            if len(scores) != len(views):
                raise RuntimeError(f"routing scorer '{ws.name}' returned {len(scores)} scores for "
                                   f"{len(views)} replicas")
            for i, s in enumerate(scores):
                weighted = s.weighted(ws.weight)
                parts[i][ws.name] = weighted
                totals[i] = totals[i] + weighted
        return [Rated(v, t, p) for v, t, p in zip(views, totals, parts, strict=True)]

    def choose(self, model: str, block_hashes: Sequence[bytes] = (), lora: str | None = None, *,
               num_prompt_tokens: int = 0, allowed: Collection[str] | None = None,
               hold_s: float | None = None) -> Reservation:
        """Reserve a slot on the best ready replica of `model` for a request; release the reservation when the
        request ends. `allowed` restricts the replicas (e.g. to the control plane's active version).

        Raises NoReadyReplica, ReplicasBusy (retry shortly) or TablesUnavailable.
        """
        request = RouteRequest(model, tuple(block_hashes), num_prompt_tokens, lora)
        views = [v for v in self.tables.snapshot(model, request.block_hashes)
                 if v.record.state == ReplicaState.READY and (allowed is None or v.replica_id in allowed)]
        if not views:
            raise NoReadyReplica(f"no ready replica of '{model}' in the routing tables")
        rated = [r for r in self.rate(request, views) if r.score.finite]  # inf (or nan) rules a replica out
        if not rated:
            raise NoReadyReplica(f"no ready replica of '{model}' can serve this request"
                                 + (f" (adapter '{lora}')" if lora else ""))
        # Ties (equal cost and load: above all a prefix no replica holds yet) go to the first candidate, so the
        # order rotates per request: new prefixes spread over the replicas instead of filling the first one's
        # cache while another's stays empty.
        shift = next(self._turns) % len(rated)
        rated = rated[shift:] + rated[:shift]
        # Pending prefill is recorded only where a scorer prices it (the tables then write it per reservation).
        candidates = [Candidate(r.view.replica_id, r.score.cost, r.score.per_request, r.score.per_queued,
                                r.score.per_pending,
                                work=float(uncached_tokens(request, r.view)) if r.score.per_pending else 0.0)
                      for r in rated]
        reservation = self.tables.reserve(model, candidates, balance=self.balance,
                                          hold_s=self.hold_s if hold_s is None else hold_s)
        reservation.num_cached_blocks = next(r.view.num_cached_blocks for r in rated
                                             if r.view.replica_id == reservation.replica_id)
        return reservation

    async def achoose(self, model: str, block_hashes: Sequence[bytes] = (), lora: str | None = None, *,
                      num_prompt_tokens: int = 0, allowed: Collection[str] | None = None,
                      hold_s: float | None = None) -> Reservation:
        """`choose` from an event loop: the tables' round trips (blocking redis-py calls) run in a worker thread."""
        return await asyncio.to_thread(self.choose, model, block_hashes, lora, num_prompt_tokens=num_prompt_tokens,
                                       allowed=allowed, hold_s=hold_s)
