"""KV-prefix-, LoRA- and load-aware routing over shared routing tables (in-process, or Redis for several gateways).

    tables = open_tables(redis_url)                      # RedisTables, or InProcessTables without a URL
    ReplicaPublisher(tables, replica_id=..., model=..., url=..., load=engine_load(engine)).start()  # a replica
    router = Router.from_config(tables)                  # a gateway: scorers from `ember_routing_scorers` plugins
    with router.choose(model, request_block_hashes(token_ids, block_size), lora) as reservation:
        ...                                              # send the request to reservation.url

Torch-free, so the gateway can import it.
"""

from ember_platform.routing.publisher import ReplicaPublisher, engine_load
from ember_platform.routing.records import (
    KV_TIERS,
    Balance,
    Candidate,
    DeploymentState,
    HeartbeatResult,
    KVFetchCosts,
    NoReadyReplica,
    ReplicaLoad,
    ReplicaRecord,
    ReplicasBusy,
    ReplicaState,
    ReplicaView,
    Reservation,
    RoutingError,
    TablesUnavailable,
)
from ember_platform.routing.router import Rated, Router, request_block_hashes
from ember_platform.routing.scoring import RouterConfig, RouteRequest, Score, Scorer, WeightedScorer, load_scorers
from ember_platform.routing.tables import RoutingTables, open_tables

__all__ = [
    "KV_TIERS", "Balance", "Candidate", "DeploymentState", "HeartbeatResult", "KVFetchCosts", "NoReadyReplica",
    "Rated", "ReplicaLoad",
    "ReplicaPublisher", "ReplicaRecord", "ReplicaState", "ReplicaView", "ReplicasBusy", "Reservation",
    "RouteRequest", "Router", "RouterConfig", "RoutingError", "RoutingTables", "Score", "Scorer",
    "TablesUnavailable", "WeightedScorer", "engine_load", "load_scorers", "open_tables", "request_block_hashes",
]
