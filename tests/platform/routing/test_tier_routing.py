"""Routing by KV tier: the tables keep the tier each block would come from (a replica's own device, CPU, disk,
else a shared S3 store), and the prefix scorer prices each fetch as the replica measured it against recomputing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ember_platform.routing import (
    KVFetchCosts,
    ReplicaLoad,
    ReplicaRecord,
    ReplicaView,
    Router,
    RouteRequest,
    RoutingTables,
)
from ember_platform.routing.scoring import WeightedScorer
from ember_plugins.routing.scorers import DEFAULT_FETCH_FRACTION, LoadScorer, PrefixScorer

Make = Callable[[], RoutingTables]
H = [bytes([i]) * 16 for i in range(32)]
BLOCK = 16
DEVICE, CPU, DISK, S3 = range(4)


def record(replica_id: str, *, shared_store: str = "", kv_costs: KVFetchCosts | None = None,
           free_blocks: int = 1000) -> ReplicaRecord:
    load = ReplicaLoad(num_free_blocks=free_blocks, num_total_blocks=1000, max_num_seqs=8, capacity=8)
    return ReplicaRecord(replica_id, "m", f"http://{replica_id}:1", block_size=BLOCK, load=load,
                         kv_costs=kv_costs or KVFetchCosts(), shared_store=shared_store)


def register(tables: RoutingTables, rec: ReplicaRecord) -> None:
    tables.heartbeat(rec, incarnation="inc", epoch=None, ttl_s=30)


def tiers_by_replica(tables: RoutingTables, hashes: list[bytes]) -> dict[str, tuple[int, ...]]:
    return {v.replica_id: v.cached_tiers for v in tables.snapshot("m", hashes)}


def test_blocks_carry_their_tier_and_a_shared_store_extends_the_run(make_tables: Make) -> None:
    replica_side, gateway_side = make_tables(), make_tables()
    costs = KVFetchCosts.of(4096, 2500.0, {"cpu": 8e9, "s3": 2e8})
    r1 = record("r1", shared_store="s3a", kv_costs=costs)
    for rec in (r1, record("r2", shared_store="s3a"), record("r3")):
        register(replica_side, rec)
    replica_side.replace_blocks("r1", {H[0]: DEVICE, H[1]: DEVICE, H[2]: CPU}, ttl_s=30)
    replica_side.replace_blocks("r3", {H[0]: DISK}, ttl_s=30)
    replica_side.update_shared("s3a", H[:5], [])

    chain = H[:6]
    assert tiers_by_replica(gateway_side, chain) == {
        "r1": (DEVICE, DEVICE, CPU, S3, S3),  # its own tiers first, then the store it shares
        "r2": (S3,) * 5,                      # nothing of its own, but it reads r1's uploads
        "r3": (DISK,),                        # no shared store: the run ends at its first miss
    }
    view = next(v for v in gateway_side.snapshot("m", chain) if v.replica_id == "r1")
    assert view.num_cached_blocks == 5 and view.num_device_blocks == 2
    assert view.record == r1  # measured costs and the store's name travel with the record

    replica_side.update_blocks("r1", {H[2]: DEVICE}, [H[0]], ttl_s=30)  # promoted; H[0] left every own tier
    assert tiers_by_replica(gateway_side, chain)["r1"] == (S3, DEVICE, DEVICE, S3, S3)
    assert gateway_side.block_tiers("r1") == {H[1]: DEVICE, H[2]: DEVICE}
    replica_side.update_shared("s3a", [], [H[3]])  # deleted from the store: the run stops there
    assert tiers_by_replica(gateway_side, chain) == {"r1": (S3, DEVICE, DEVICE), "r2": (S3, S3, S3),
                                                     "r3": (DISK,)}
    assert gateway_side.shared_blocks("s3a") == {H[0], H[1], H[2], H[4]}

    with pytest.raises(ValueError, match="tier rank"):
        replica_side.update_blocks("r1", {H[5]: 7}, [], ttl_s=30)


def view(replica_id: str, tiers: tuple[int, ...], **kw: object) -> ReplicaView:
    return ReplicaView(record(replica_id, **kw), 0, len(tiers), tiers)  # type: ignore[arg-type]


def test_a_fetch_is_priced_as_measured_bytes_over_bandwidth_in_prefill_tokens() -> None:
    # 1 MB blocks; CPU reads 1 GB/s (1 ms a block), S3 50 MB/s (20 ms); prefill runs 2,000 tokens/s (8 ms a block).
    costs = KVFetchCosts.of(10**6, 2000.0, {"cpu": 1e9, "s3": 5e7})
    request = RouteRequest("m", tuple(H[:10]))  # 160 prompt tokens
    scores = PrefixScorer().score(request, [
        view("device", (DEVICE,) * 10, kv_costs=costs),
        view("cpu", (DEVICE,) * 4 + (CPU,) * 6, kv_costs=costs),
        view("s3", (S3,) * 10, kv_costs=costs),
        view("disk-unmeasured", (DISK,) * 10, kv_costs=costs),
        view("none", (), kv_costs=costs),
    ])
    assert [s.cost for s in scores] == pytest.approx([
        0.0,
        6 * 0.001 * 2000,               # 6 CPU fetches of 2 tokens' worth each
        10 * 0.020 * 2000,              # S3 here is slower than recomputing: 40 tokens a block against 16
        10 * DEFAULT_FETCH_FRACTION["disk"] * BLOCK,  # not measured yet: the default fraction of a recompute
        160.0,
    ])


def test_router_prefers_the_fastest_tier_and_recomputes_rather_than_fetch_slowly(make_tables: Make) -> None:
    tables = make_tables()
    # Per block, in prefill tokens: CPU 2, disk 5, S3 10; recomputing costs 16.
    fast = KVFetchCosts.of(10**6, 2000.0, {"cpu": 1e9, "disk": 4e8, "s3": 2e8})
    chain = H[:16]
    for name in ("a-device", "b-cpu", "c-disk", "d-s3", "e-none"):
        register(tables, record(name, shared_store="store" if name == "d-s3" else "", kv_costs=fast))
    tables.replace_blocks("a-device", dict.fromkeys(chain, DEVICE), ttl_s=30)
    tables.replace_blocks("b-cpu", dict.fromkeys(chain, CPU), ttl_s=30)
    tables.replace_blocks("c-disk", dict.fromkeys(chain, DISK), ttl_s=30)
    tables.update_shared("store", chain, [])
    router = Router(tables, [WeightedScorer("prefix", 1.0, PrefixScorer())])

    order = []
    for _ in range(4):
        with router.choose("m", chain) as reservation:
            order.append(reservation.replica_id)
        tables.remove_replica("m", reservation.replica_id)  # next time: the best of the rest
    assert order == ["a-device", "b-cpu", "c-disk", "d-s3"]

    # An S3 measured slower than recomputing (a block 50 ms away, 8 ms to recompute) loses to a replica
    # with nothing cached.
    register(tables, record("d-s3", shared_store="store", kv_costs=KVFetchCosts.of(10**6, 2000.0, {"s3": 2e7})))
    with router.choose("m", chain) as reservation:
        assert reservation.replica_id == "e-none"


def test_blocks_fetched_from_lower_tiers_still_need_free_device_blocks() -> None:
    request = RouteRequest("m", tuple(H[:10]))
    on_device = view("dev", (DEVICE,) * 10, free_blocks=0)
    in_cpu = view("cpu", (CPU,) * 10, free_blocks=0)
    scores = LoadScorer().score(request, [on_device, in_cpu])
    assert scores[0].cost == 0.0  # nothing to allocate
    assert scores[1].cost == 10 * BLOCK  # ten blocks to bring in, none free
