"""The built-in router scorers. Costs are in tokens of work (see ember_platform.routing.scoring).

* `prefix` — the prompt tokens a replica would have to prefill: the prompt minus the longest prefix of its
  block-hash chain that the replica can reuse (hashes chain, so a later block is reusable only after the earlier),
  plus, for each reused block that is not in device memory, its fetch priced in tokens: the block's bytes over
  that tier's read bandwidth, times the replica's prefill rate, both as the replica measured them (device >
  CPU > disk > S3 follows from the measurements rather than being assumed).
* `load` — a small cost per request in flight (decode slows a little with every sequence in the batch), a large
  one for a request that would queue behind a full batch, the tokens whose KV would not fit in free blocks, and
  optionally (`pending_cost`, off by default) the prompt tokens the replica has yet to prefill for requests already
  routed to it (counted until the gateway sees the first bytes of each one's response).
  bench_routing.py measured it off against on (1.0): 3.06x against 2.28x more prompt tokens from cache than round
  robin, 2.34x against 1.15x lower mean TTFT. Diverting a request from the replica that holds
  its prefix costs another replica's cache a prefix, and chunked prefill overlaps the wait it was meant to avoid.
* `lora` — nothing where the adapter is resident, `load_cost` where it would have to be loaded first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ember_platform.api import KV_TIERS, ReplicaView, RouteRequest, Score

# A fetch's price as a fraction of recomputing the block, until the replica has measured both (bench_kv_tiers on
# a 2-core CPU: 24x, 17x and 8.4x faster than recomputing; rounded towards caution).
DEFAULT_FETCH_FRACTION = {"cpu": 1 / 16, "disk": 1 / 8, "s3": 1 / 4}


class PrefixScorer:
    def __init__(self, cpu: float = DEFAULT_FETCH_FRACTION["cpu"], disk: float = DEFAULT_FETCH_FRACTION["disk"],
                 s3: float = DEFAULT_FETCH_FRACTION["s3"]) -> None:
        self.default_fraction = {"cpu": float(cpu), "disk": float(disk), "s3": float(s3)}
        for tier, fraction in self.default_fraction.items():
            if fraction < 0:
                raise ValueError(f"prefix scorer: {tier} (default fetch cost as a fraction of recomputing) must be "
                                 f">= 0, got {fraction}")

    def fetch_tokens(self, view: ReplicaView, tier: str) -> float:
        """What fetching one block from `tier` costs `view`'s replica, in tokens of prefill time."""
        if tier == "device":
            return 0.0
        costs = view.record.kv_costs
        seconds = costs.fetch_seconds(tier)
        if seconds is not None and costs.prefill_tokens_per_s > 0:
            return seconds * costs.prefill_tokens_per_s
        return self.default_fraction[tier] * view.record.block_size

    def score(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[Score]:
        scores = []
        for view in replicas:
            block_size = view.record.block_size
            uncached = max(0, request.prompt_tokens(block_size) - view.num_cached_blocks * block_size)
            fetch = sum(n * self.fetch_tokens(view, KV_TIERS[rank])
                        for rank, n in Counter(view.cached_tiers).items())
            scores.append(Score(cost=float(uncached + fetch)))
        return scores


class LoadScorer:
    def __init__(self, running_cost: float = 32.0, queued_cost: float = 2048.0, pending_cost: float = 0.0) -> None:
        if running_cost < 0 or queued_cost < 0 or pending_cost < 0:
            raise ValueError(f"load scorer: running_cost, queued_cost and pending_cost must be >= 0, got "
                             f"{running_cost}, {queued_cost}, {pending_cost}")
        self.running_cost = float(running_cost)
        self.queued_cost = float(queued_cost)
        self.pending_cost = float(pending_cost)

    def score(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[Score]:
        scores = []
        for view in replicas:
            load, block_size = view.load, view.record.block_size
            kv_short = 0
            if load.num_total_blocks:  # a replica that reports no KV figures is not penalized for them
                # Blocks fetched from a lower tier need free device blocks too, like the ones computed.
                uncached = request.prompt_tokens(block_size) - view.num_device_blocks * block_size
                needed = -(-max(0, uncached) // block_size)
                kv_short = max(0, needed - load.num_free_blocks) * block_size
            scores.append(Score(cost=float(kv_short), per_request=self.running_cost, per_queued=self.queued_cost,
                                per_pending=self.pending_cost))
        return scores


class LoraScorer:
    def __init__(self, load_cost: float = 2048.0) -> None:
        if load_cost < 0:
            raise ValueError(f"lora scorer: load_cost must be >= 0, got {load_cost}")
        self.load_cost = float(load_cost)

    def score(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[Score]:
        if not request.lora:
            return [Score() for _ in replicas]
        return [Score(cost=0.0 if request.lora in view.record.adapters else self.load_cost) for view in replicas]
