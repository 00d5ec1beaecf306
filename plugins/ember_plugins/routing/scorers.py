"""The built-in router scorers. Costs are in tokens of work (see ember_platform.routing.scoring).

* `prefix` — the prompt tokens a replica would have to prefill: the prompt minus the longest prefix of its
  block-hash chain that the replica holds (hashes chain, so a later block is reusable only after the earlier).
* `load` — a small cost per request in flight (decode slows a little with every sequence in the batch), a large
  one for a request that would queue behind a full batch, and the tokens whose KV would not fit in free blocks.
* `lora` — nothing where the adapter is resident, `load_cost` where it would have to be loaded first.
"""

from __future__ import annotations

from collections.abc import Sequence

from ember_platform.routing.records import ReplicaView
from ember_platform.routing.scoring import RouteRequest, Score


class PrefixScorer:
    def score(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[Score]:
        scores = []
        for view in replicas:
            block_size = view.record.block_size
            uncached = request.prompt_tokens(block_size) - view.num_cached_blocks * block_size
            scores.append(Score(cost=float(max(0, uncached))))
        return scores


class LoadScorer:
    def __init__(self, running_cost: float = 32.0, queued_cost: float = 2048.0) -> None:
        if running_cost < 0 or queued_cost < 0:
            raise ValueError(f"load scorer: running_cost and queued_cost must be >= 0, got {running_cost}, "
                             f"{queued_cost}")
        self.running_cost = float(running_cost)
        self.queued_cost = float(queued_cost)

    def score(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[Score]:
        scores = []
        for view in replicas:
            load, block_size = view.load, view.record.block_size
            kv_short = 0
            if load.num_total_blocks:  # a replica that reports no KV figures is not penalized for them
                uncached = request.prompt_tokens(block_size) - view.num_cached_blocks * block_size
                needed = -(-max(0, uncached) // block_size)
                kv_short = max(0, needed - load.num_free_blocks) * block_size
            scores.append(Score(cost=float(kv_short), per_request=self.running_cost, per_queued=self.queued_cost))
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
