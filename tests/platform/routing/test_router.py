"""The router over both table backends: prefix, load and LoRA scoring, the imbalance bound, atomic reservation."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Callable

import pytest

import ember_plugins.routing
from ember.errors import PluginError
from ember.plugins import PluginHost
from ember_platform.routing import (
    Balance,
    NoReadyReplica,
    ReplicaLoad,
    ReplicaRecord,
    ReplicasBusy,
    Reservation,
    Router,
    RouterConfig,
    RoutingTables,
    request_block_hashes,
)
from ember_platform.routing.scoring import parse_weights

Make = Callable[[], RoutingTables]
BLOCK = 16
SYSTEM_PROMPT = list(range(1000, 1000 + 62 * BLOCK))  # ~1k tokens: 62 full blocks


def plugin_host() -> PluginHost:
    host = PluginHost(entry_points=False, disabled=())
    host.register(ember_plugins.routing, "routing")
    return host


def make_router(tables: RoutingTables, *, weights: dict[str, float] | None = None,
                balance: Balance | None = None, **options: dict) -> Router:
    config = RouterConfig(weights=weights or {"prefix": 1.0, "load": 1.0, "lora": 1.0}, options=options,
                          balance=balance or Balance())
    return Router.from_config(tables, config, host=plugin_host())


def add_replicas(tables: RoutingTables, *ids: str, capacity: int = 64, max_num_seqs: int = 64,
                 adapters: dict[str, set[str]] | None = None) -> None:
    for replica_id in ids:
        load = ReplicaLoad(num_free_blocks=1000, num_total_blocks=1000, max_num_seqs=max_num_seqs, capacity=capacity)
        rec = ReplicaRecord(replica_id, "m", f"http://{replica_id}", block_size=BLOCK, load=load,
                            adapters=frozenset((adapters or {}).get(replica_id, set())))
        tables.heartbeat(rec, incarnation=replica_id, epoch=None, ttl_s=60)


def test_prefix_scoring_picks_the_replica_with_the_longest_cached_prefix(make_tables: Make) -> None:
    tables = make_tables()
    add_replicas(tables, "a", "b", "c")
    chain = request_block_hashes(list(range(10 * BLOCK)), BLOCK)
    tables.replace_blocks("a", chain[:3], ttl_s=60)
    tables.replace_blocks("b", chain[:7], ttl_s=60)
    tables.replace_blocks("c", chain[:2] + chain[3:10], ttl_s=60)  # more blocks, but a hole at block 2
    router = make_router(make_tables())
    with router.choose("m", chain, num_prompt_tokens=10 * BLOCK + 5) as reservation:
        assert reservation.replica_id == "b" and reservation.num_cached_blocks == 7
        assert reservation.cost == pytest.approx(3 * BLOCK + 5)  # uncached tokens; nothing else in flight


def test_block_hashes_match_what_the_engine_caches() -> None:
    """The gateway's hashes (router.request_block_hashes) are the ones the engine's KV events report."""
    from ember_platform.engine.kv_cache_manager import KVCacheManager
    from ember_platform.engine.request import Request

    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    prompt = list(range(5 * BLOCK + 3))
    req = Request("r", prompt, None, 0, lora_name="sql")  # type: ignore[arg-type]
    assert kv.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_blocks(req)
    assert kv.drain_events().stored == list(request_block_hashes(prompt, BLOCK, lora="sql"))
    assert request_block_hashes(prompt, BLOCK) != request_block_hashes(prompt, BLOCK, lora="sql")


def test_imbalance_bound_spreads_a_hot_prefix(make_tables: Make) -> None:
    tables = make_tables()
    add_replicas(tables, "a", "b", "c")
    chain = request_block_hashes(SYSTEM_PROMPT, BLOCK)
    tables.replace_blocks("a", chain, ttl_s=60)  # every request shares this system prompt; only "a" has it
    unbounded = make_router(make_tables(), balance=Balance(abs_threshold=10_000))
    taken = [unbounded.choose("m", chain) for _ in range(24)]
    assert Counter(r.replica_id for r in taken) == {"a": 24}  # the cache wins every time: a hot spot
    for r in taken:
        r.release()

    bounded = make_router(make_tables(), balance=Balance(abs_threshold=4, rel_threshold=1.5))
    taken = [bounded.choose("m", chain) for _ in range(24)]
    counts = Counter(r.replica_id for r in taken)
    assert set(counts) == {"a", "b", "c"}
    assert counts["a"] == max(counts.values())  # the cache still counts...
    assert counts["a"] - min(counts.values()) <= 4 + 1  # ...within the bound


def test_a_saturated_replica_sends_the_rest_elsewhere(make_tables: Make) -> None:
    tables = make_tables()
    add_replicas(tables, "a", "b", "c", capacity=4, max_num_seqs=4)
    chain = request_block_hashes(SYSTEM_PROMPT, BLOCK)
    tables.replace_blocks("a", chain, ttl_s=60)
    router = make_router(make_tables(), balance=Balance(abs_threshold=10_000))
    taken = [router.choose("m", chain) for _ in range(12)]
    assert [r.replica_id for r in taken[:4]] == ["a"] * 4
    assert Counter(r.replica_id for r in taken) == {"a": 4, "b": 4, "c": 4}
    with pytest.raises(ReplicasBusy):
        router.choose("m", chain)
    taken[5].release()
    assert router.choose("m", chain).replica_id == taken[5].replica_id


def test_queueing_costs_more_than_a_cache_miss(make_tables: Make) -> None:
    # "a" holds the prefix but its batch is full: waiting for a slot there costs more than recomputing elsewhere.
    tables = make_tables()
    add_replicas(tables, "a", "b", capacity=8, max_num_seqs=2)
    chain = request_block_hashes(SYSTEM_PROMPT, BLOCK)
    tables.replace_blocks("a", chain, ttl_s=60)
    router = make_router(make_tables(), balance=Balance(abs_threshold=10_000))
    assert [router.choose("m", chain).replica_id for _ in range(3)] == ["a", "a", "b"]


def test_lora_residency_is_preferred(make_tables: Make) -> None:
    tables = make_tables()
    add_replicas(tables, "a", "b", "c", adapters={"b": {"sql"}, "c": {"chat"}})
    router = make_router(make_tables(), lora={"load_cost": 500})
    with router.choose("m", request_block_hashes(list(range(64)), BLOCK, lora="sql"), lora="sql") as r:
        assert r.replica_id == "b"
    with router.choose("m", lora="chat") as r:
        assert r.replica_id == "c"
    with router.choose("m", lora="new") as r:  # resident nowhere: every replica pays the same load cost
        assert r.cost == pytest.approx(500)
    # A long cached prefix can outweigh a cheap adapter load: the costs share one unit.
    chain = request_block_hashes(SYSTEM_PROMPT, BLOCK, lora="sql")
    tables.replace_blocks("a", chain, ttl_s=60)
    with router.choose("m", chain, lora="sql") as r:
        assert r.replica_id == "a"


def race_for_one_slot(gateways: list[Router]) -> list[Reservation]:
    """Every gateway asks at the same moment, each from its own thread; returns the reservations won."""
    barrier = threading.Barrier(len(gateways))
    won: list[Reservation] = []

    def ask(router: Router) -> None:
        barrier.wait()
        with contextlib.suppress(ReplicasBusy):
            won.append(router.choose("m"))

    threads = [threading.Thread(target=ask, args=(g,)) for g in gateways]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won


def test_two_gateways_never_both_take_the_last_slot(make_tables: Make) -> None:
    tables = make_tables()
    add_replicas(tables, "only", capacity=3, max_num_seqs=3)
    gateways = [make_router(make_tables()), make_router(make_tables())]  # separate clients: separate gateways
    for _ in range(150):
        held = [gateways[0].choose("m"), gateways[1].choose("m")]  # one slot left
        won = race_for_one_slot(gateways)
        assert len(won) == 1
        assert tables.snapshot("m")[0].num_in_flight == 3
        for r in held + won:
            r.release()


def test_many_threads_fill_every_slot_exactly_once(make_tables: Make) -> None:
    tables = make_tables()
    add_replicas(tables, "a", "b", capacity=5, max_num_seqs=5)
    gateways = [make_router(make_tables()), make_router(make_tables())]
    won: list[str] = []
    lock = threading.Lock()

    def hammer(router: Router) -> None:
        for _ in range(10):
            try:
                r = router.choose("m")
            except ReplicasBusy:
                continue
            with lock:
                won.append(r.replica_id)

    threads = [threading.Thread(target=hammer, args=(gateways[i % 2],)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(won) == {"a": 5, "b": 5}


def test_choose_from_an_event_loop(make_tables: Make) -> None:
    tables = make_tables()
    add_replicas(tables, "a")
    router = make_router(make_tables())

    async def route() -> str:
        with await router.achoose("m") as reservation:
            return reservation.replica_id

    assert asyncio.run(route()) == "a"


def test_no_ready_replica_and_allowed_set(make_tables: Make) -> None:
    tables = make_tables()
    router = make_router(tables)
    with pytest.raises(NoReadyReplica):
        router.choose("m")
    add_replicas(tables, "old", "new")
    assert router.choose("m", allowed={"new"}).replica_id == "new"
    with pytest.raises(NoReadyReplica):
        router.choose("m", allowed=set())


def test_scorers_come_from_plugins_with_weights_from_configuration() -> None:
    from ember_platform.routing.memory import InProcessTables

    router = make_router(InProcessTables(), weights={"prefix": 2.0, "lora": 0.0})
    assert [(s.name, s.weight) for s in router.scorers] == [("prefix", 2.0)]
    with pytest.raises(PluginError, match=r"scorer 'geo', which no installed plugin provides \(available: "
                                          r"load, lora, prefix\)"):
        make_router(InProcessTables(), weights={"geo": 1.0})
    with pytest.raises(PluginError, match=r"routing scorer 'load' rejected its options"):
        make_router(InProcessTables(), load={"bogus": 1})


def test_router_config_from_mapping_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = RouterConfig.from_mapping({"weights": {"prefix": 1, "load": 0.5}, "balance_abs": 3,
                                        "balance_rel": 2.0, "options": {"lora": {"load_cost": 100}}})
    assert config.balance == Balance(3, 2.0) and config.options["lora"] == {"load_cost": 100}
    assert RouterConfig.from_mapping({}) == RouterConfig()
    with pytest.raises(ValueError, match="balance_abs must be >= 0"):
        RouterConfig.from_mapping({"balance_rel": 0.5})
    with pytest.raises(ValueError, match="unknown key 'balance'"):
        RouterConfig.from_mapping({"balance": 3})
    with pytest.raises(ValueError, match=r"weights.load must be a number >= 0"):
        RouterConfig.from_mapping({"weights": {"load": -1}})
    monkeypatch.setenv("EMBER_ROUTING_WEIGHTS", "load=2, lora=0")
    assert RouterConfig.from_env(config).weights == {"prefix": 1, "load": 2.0, "lora": 0.0}
    with pytest.raises(ValueError, match="is not NAME=WEIGHT"):
        parse_weights("prefix")
