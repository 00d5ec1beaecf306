"""The replica's publisher: heartbeats, batched KV events, adapters, resync; and the engine -> router path."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import ember_plugins.routing
from ember.plugins import PluginHost
from ember_platform.engine.kv_cache_manager import KVCacheManager
from ember_platform.engine.request import Request
from ember_platform.routing import (
    ReplicaLoad,
    ReplicaPublisher,
    ReplicaState,
    Router,
    RouterConfig,
    RoutingTables,
    engine_load,
    request_block_hashes,
)

Make = Callable[[], RoutingTables]
H = [bytes([i]) * 16 for i in range(16)]
BLOCK = 4


def publisher(tables: RoutingTables, replica_id: str = "r1", **kwargs: object) -> ReplicaPublisher:
    return ReplicaPublisher(tables, replica_id=replica_id, model="m", url=f"http://{replica_id}",
                            load=lambda: ReplicaLoad(max_num_seqs=4), block_size=BLOCK,
                            state=ReplicaState.READY, **kwargs)  # type: ignore[arg-type]


def wait_for(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_first_heartbeat_sends_the_whole_block_set_then_batches(make_tables: Make) -> None:
    tables = make_tables()
    pub = publisher(make_tables())
    pub.record_kv_events(stored=H[:4], removed=[])
    pub.publish()
    assert pub.num_resyncs == 1 and tables.blocks("r1") == set(H[:4])
    pub.record_kv_events(stored=H[4:6], removed=[H[0]])
    pub.flush()
    assert tables.blocks("r1") == set(H[1:6]) and pub.num_resyncs == 1


def test_events_in_one_batch_end_where_the_engine_ended(make_tables: Make) -> None:
    tables = make_tables()
    pub = publisher(make_tables())
    pub.record_kv_events(stored=[H[0]], removed=[])
    pub.publish()
    # H[0] evicted then cached again, H[1] cached then evicted, H[2] cached twice around one eviction.
    pub.record_kv_events(stored=[H[0], H[1], H[2], H[2]], removed=[H[0], H[1], H[2]])
    pub.flush()
    assert tables.blocks("r1") == {H[0], H[2]} == pub.blocks


def test_background_thread_publishes_state_adapters_and_events(make_tables: Make) -> None:
    tables = make_tables()
    pub = publisher(make_tables(), heartbeat_s=0.1, flush_s=0.02).start()
    try:
        wait_for(lambda: [v.replica_id for v in tables.snapshot("m")] == ["r1"])
        pub.record_kv_events(stored=H[:3], removed=[])
        pub.set_adapters({"sql"})
        wait_for(lambda: tables.blocks("r1") == set(H[:3]))
        wait_for(lambda: tables.snapshot("m")[0].record.adapters == {"sql"})
        pub.set_state(ReplicaState.DRAINING)
        wait_for(lambda: tables.snapshot("m")[0].record.state == ReplicaState.DRAINING)
    finally:
        pub.close()
    assert tables.snapshot("m") == []  # it left at once instead of waiting for its lease to lapse


def test_a_lapsed_lease_is_renewed_with_a_resync(make_tables: Make) -> None:
    tables = make_tables()
    pub = publisher(make_tables(), ttl_s=0.2)
    pub.record_kv_events(stored=H[:2], removed=[])
    pub.publish()
    time.sleep(0.3)  # the replica stalled past its lease
    assert tables.snapshot("m") == []
    pub.record_kv_events(stored=[H[2]], removed=[])
    pub.publish()
    assert pub.num_resyncs == 2 and tables.blocks("r1") == set(H[:3])


def test_a_replica_that_stops_beating_drops_out_within_its_lease(make_tables: Make) -> None:
    tables = make_tables()
    pub = publisher(make_tables(), heartbeat_s=0.05, ttl_s=0.3).start()
    wait_for(lambda: len(tables.snapshot("m")) == 1)
    pub.close(deregister=False)  # like kill -9: no goodbye
    start = time.monotonic()
    wait_for(lambda: tables.snapshot("m") == [], timeout=3)
    assert time.monotonic() - start < 0.3 + 0.7  # the lease, plus slack for a loaded test machine


def test_engine_events_reach_the_router(make_tables: Make) -> None:
    """A real KV cache manager's events, published, steer the next request with the same prefix."""
    host = PluginHost(entry_points=False, disabled=())
    host.register(ember_plugins.routing, "routing")
    router = Router.from_config(make_tables(), RouterConfig(), host=host)
    engines = {rid: KVCacheManager(num_blocks=64, block_size=BLOCK) for rid in ("r1", "r2")}
    pubs = {rid: ReplicaPublisher(make_tables(), replica_id=rid, model="m", url=f"http://{rid}", block_size=BLOCK,
                                  state=ReplicaState.READY, load=engine_load(_EngineStub(kv)))
            for rid, kv in engines.items()}
    prompt = list(range(40))
    hashes = request_block_hashes(prompt, BLOCK)
    for pub in pubs.values():
        pub.publish()

    first = router.choose("m", hashes, num_prompt_tokens=len(prompt))
    kv = engines[first.replica_id]
    req = Request("x", prompt, None, 0)  # type: ignore[arg-type]
    assert kv.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_blocks(req)
    kv.free(req)
    first.release()
    events = kv.drain_events()
    pubs[first.replica_id].record_kv_events(events.stored, events.removed)
    pubs[first.replica_id].flush()

    for _ in range(3):
        with router.choose("m", hashes, num_prompt_tokens=len(prompt)) as again:
            assert again.replica_id == first.replica_id and again.num_cached_blocks == len(hashes)
    assert router.tables.snapshot("m")[[*engines].index(first.replica_id)].load.num_free_blocks == 64


class _EngineStub:
    """The two attributes of LLMEngine that `engine_load` reads, over a real KV cache manager."""

    def __init__(self, kv: KVCacheManager) -> None:
        from ember_platform.engine.scheduler import Scheduler

        self.kv = kv
        self.scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)


@pytest.mark.parametrize("heartbeat_s", [0.05])
def test_publisher_survives_an_unreachable_store(heartbeat_s: float) -> None:
    from ember_platform.routing.redis_tables import RedisTables

    tables = RedisTables.from_url("redis://127.0.0.1:1/0", timeout_s=0.2)  # nothing listens on port 1
    pub = publisher(tables, heartbeat_s=heartbeat_s).start()
    time.sleep(0.2)
    assert not pub.in_sync
    pub.close()  # logs that it could not deregister, does not raise
