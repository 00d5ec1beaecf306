"""The routing tables on both backends: records, blocks, leases, deployment states, reservations."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from ember_platform.routing import (
    Balance,
    Candidate,
    DeploymentState,
    NoReadyReplica,
    ReplicaLoad,
    ReplicaRecord,
    ReplicasBusy,
    ReplicaState,
    RoutingTables,
)
from ember_platform.routing.tables import Slot, pick

Make = Callable[[], RoutingTables]
H = [bytes([i]) * 16 for i in range(32)]  # stand-ins for 16-byte block hashes


def record(replica_id: str = "r1", *, model: str = "m", state: ReplicaState = ReplicaState.READY,
           capacity: int = 4, max_num_seqs: int = 4, adapters: frozenset[str] = frozenset()) -> ReplicaRecord:
    load = ReplicaLoad(num_running=1, num_waiting=2, num_free_blocks=30, num_total_blocks=64,
                       max_num_seqs=max_num_seqs, capacity=capacity)
    return ReplicaRecord(replica_id, model, f"http://{replica_id}:1", version="0.1.0", state=state, block_size=16,
                         load=load, adapters=adapters)


def register(tables: RoutingTables, rec: ReplicaRecord, *, ttl_s: float = 30.0, incarnation: str = "inc") -> None:
    tables.heartbeat(rec, incarnation=incarnation, epoch=None, ttl_s=ttl_s)


def test_records_blocks_and_adapters_round_trip(make_tables: Make) -> None:
    replica_side, gateway_side = make_tables(), make_tables()
    rec = record(adapters=frozenset({"sql", "chat"}))
    first = replica_side.heartbeat(rec, incarnation="inc", epoch=None, ttl_s=30)
    assert first.resync  # nothing is known about this replica yet: send everything
    again = replica_side.heartbeat(rec, incarnation="inc", epoch=first.epoch, ttl_s=30)
    assert not again.resync and again.epoch == first.epoch

    replica_side.replace_blocks("r1", H[:6], ttl_s=30)
    replica_side.update_blocks("r1", stored=H[6:8], removed=[H[1]], ttl_s=30)
    assert gateway_side.blocks("r1") == set(H[:8]) - {H[1]}

    (view,) = gateway_side.snapshot("m", H[:8])
    assert view.record == rec
    assert view.num_cached_blocks == 1  # H[1] is gone: the chain breaks there, later hits are unusable
    assert view.num_in_flight == 0
    assert gateway_side.snapshot("other-model") == []


def test_prefix_match_counts_the_leading_run_of_a_long_chain(make_tables: Make) -> None:
    tables = make_tables()
    register(tables, record())
    chain = [bytes([i % 256, i // 256]) * 8 for i in range(9000)]  # longer than one Lua unpack() chunk
    tables.replace_blocks("r1", chain[:8500], ttl_s=30)
    assert tables.snapshot("m", chain)[0].num_cached_blocks == 8500
    assert tables.snapshot("m", [])[0].num_cached_blocks == 0


def test_a_replica_disappears_when_its_lease_lapses(make_tables: Make) -> None:
    tables, other_gateway = make_tables(), make_tables()
    register(tables, record("dying"), ttl_s=0.3)
    register(tables, record("alive"), ttl_s=30)
    tables.replace_blocks("dying", H[:3], ttl_s=0.3)
    assert [v.replica_id for v in other_gateway.snapshot("m")] == ["alive", "dying"]
    time.sleep(0.45)
    assert [v.replica_id for v in other_gateway.snapshot("m")] == ["alive"]
    with pytest.raises(NoReadyReplica):
        other_gateway.reserve("m", [Candidate("dying")], balance=Balance())
    assert tables.blocks("dying") == set()
    # It comes back (it was only paused): the tables no longer hold its blocks, so it must resync.
    assert tables.heartbeat(record("dying"), incarnation="inc", epoch=None, ttl_s=30).resync


def test_a_new_incarnation_resyncs_and_drops_the_old_blocks(make_tables: Make) -> None:
    tables = make_tables()
    epoch = tables.heartbeat(record(), incarnation="first", epoch=None, ttl_s=30).epoch
    tables.replace_blocks("r1", H[:4], ttl_s=30)
    result = tables.heartbeat(record(), incarnation="restarted", epoch=epoch, ttl_s=30)
    assert result.resync and tables.blocks("r1") == set()


def test_remove_replica_forgets_it_at_once(make_tables: Make) -> None:
    tables = make_tables()
    register(tables, record())
    tables.replace_blocks("r1", H[:2], ttl_s=30)
    tables.remove_replica("m", "r1")
    assert tables.snapshot("m") == [] and tables.blocks("r1") == set()


def test_deployment_state_is_stored_or_derived(make_tables: Make) -> None:
    writer, reader = make_tables(), make_tables()
    assert reader.deployment_state("m") is DeploymentState.COLD
    register(writer, record())
    assert reader.deployment_state("m") is DeploymentState.WARM  # none stored (e.g. after a restart): replicas
    writer.set_deployment_state("m", DeploymentState.SLEEPING)
    assert reader.deployment_state("m") is DeploymentState.SLEEPING
    assert reader.stored_deployment_state("other") is None


def test_reservations_respect_capacity_and_release(make_tables: Make) -> None:
    tables = make_tables()
    register(tables, record(capacity=2))
    first = tables.reserve("m", [Candidate("r1")], balance=Balance())
    second = tables.reserve("m", [Candidate("r1")], balance=Balance())
    assert (first.num_in_flight, second.num_in_flight) == (1, 2) and first.url == "http://r1:1"
    with pytest.raises(ReplicasBusy):
        tables.reserve("m", [Candidate("r1")], balance=Balance())
    first.release()
    first.release()  # twice is harmless: it must not free someone else's slot
    assert tables.snapshot("m")[0].num_in_flight == 1
    with tables.reserve("m", [Candidate("r1")], balance=Balance()) as third:
        assert third.num_in_flight == 2
    assert tables.snapshot("m")[0].num_in_flight == 1


def test_a_reservation_whose_holder_died_expires(make_tables: Make) -> None:
    tables = make_tables()
    register(tables, record(capacity=1))
    tables.reserve("m", [Candidate("r1")], balance=Balance(), hold_s=0.2)  # never released
    with pytest.raises(ReplicasBusy):
        tables.reserve("m", [Candidate("r1")], balance=Balance())
    time.sleep(0.3)
    assert tables.reserve("m", [Candidate("r1")], balance=Balance()).num_in_flight == 1


def test_only_ready_replicas_of_the_model_are_reserved(make_tables: Make) -> None:
    tables = make_tables()
    register(tables, record("draining", state=ReplicaState.DRAINING))
    register(tables, record("elsewhere", model="other"))
    with pytest.raises(NoReadyReplica):
        tables.reserve("m", [Candidate("draining"), Candidate("elsewhere"), Candidate("unknown")],
                       balance=Balance())


def test_retried_reservation_keeps_its_one_slot(make_tables: Make) -> None:
    # A call whose reply was lost with the connection is retried with the same token: it must not take two slots.
    tables = make_tables()
    register(tables, record(capacity=3))
    a = tables.reserve("m", [Candidate("r1")], balance=Balance(), token="t")
    b = tables.reserve("m", [Candidate("r1")], balance=Balance(), token="t")
    assert a.replica_id == b.replica_id and tables.snapshot("m")[0].num_in_flight == 1


def test_both_backends_decide_like_the_reference_rule(make_tables: Make) -> None:
    """The Lua script and the in-process backend must agree with `pick` on random loads and costs."""
    rng = random.Random(7)
    tables = make_tables()
    ids = [f"r{i}" for i in range(4)]
    for trial in range(40):
        caps = {i: rng.randint(1, 6) for i in ids}
        seqs = {i: rng.randint(1, 4) for i in ids}
        for i in ids:
            tables.remove_replica("m", i)
            register(tables, record(i, capacity=caps[i], max_num_seqs=seqs[i]))
            for _ in range(rng.randint(0, caps[i])):
                tables.reserve("m", [Candidate(i)], balance=Balance(100, 100.0))
        loads = {v.replica_id: v.num_in_flight for v in tables.snapshot("m")}
        candidates = [Candidate(i, rng.choice([0.0, 16.0, 100.5]), rng.choice([0.0, 8.0]), rng.choice([0.0, 64.0]))
                      for i in ids]
        balance = Balance(rng.randint(0, 3), rng.choice([1.0, 1.5, 3.0]))
        expected = pick([Slot(c, loads[c.replica_id], caps[c.replica_id], seqs[c.replica_id])
                         for c in candidates], balance)
        if expected is None:
            with pytest.raises(ReplicasBusy):
                tables.reserve("m", candidates, balance=balance)
        else:
            got = tables.reserve("m", candidates, balance=balance)
            assert got.replica_id == candidates[expected].replica_id, f"trial {trial}"


def test_open_tables_picks_the_backend_from_the_url(redis_server, namespace: str) -> None:
    from ember_platform.routing import open_tables
    from ember_platform.routing.memory import InProcessTables
    from ember_platform.routing.redis_tables import RedisTables

    assert isinstance(open_tables(None), InProcessTables)
    tables = open_tables(redis_server.url, namespace=namespace)
    assert isinstance(tables, RedisTables) and tables.snapshot("m") == []
    tables.close()


def test_pending_prefill_delays_a_replica_until_the_first_token(make_tables: Make) -> None:
    """A reserved request's uncached prompt is work the replica does before anything routed after it; it counts
    against the replica from the reservation until the request's first token."""
    tables = make_tables()
    for rid in ("a", "b"):
        register(tables, record(rid, capacity=8, max_num_seqs=8))

    def offer(cost_b: float) -> list[Candidate]:
        # "a" holds most of the prompt (10 tokens to prefill), "b" little of it (cost_b more).
        return [Candidate("a", cost=0.0, per_pending=1.0, work=10.0),
                Candidate("b", cost=cost_b, per_pending=1.0, work=10.0 + cost_b)]

    long_miss = tables.reserve("m", [Candidate("a", per_pending=1.0, work=1000.0)], balance=Balance())
    assert long_miss.replica_id == "a" and long_miss.pending_work == 1000.0
    behind = tables.reserve("m", offer(500.0), balance=Balance())
    assert (behind.replica_id, behind.cost) == ("b", 500.0)  # 500 tokens here beat waiting for a's 1,000
    long_miss.prefilled()  # its first token: "a" is free to prefill again
    after = tables.reserve("m", offer(500.0), balance=Balance())
    assert (after.replica_id, after.cost) == ("a", 0.0)
    long_miss.prefilled()  # idempotent
    for reservation in (long_miss, behind, after):
        reservation.release()
    quiet = tables.reserve("m", offer(1.0), balance=Balance())
    assert (quiet.replica_id, quiet.cost) == ("a", 0.0)  # released: no pending work left anywhere
    quiet.release()
