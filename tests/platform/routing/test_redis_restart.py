"""A Redis restart: gateways and replicas reconnect, and the tables rebuild from heartbeats and resyncs."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from ember.plugins import PluginHost
from ember_platform.routing import (
    ReplicaLoad,
    ReplicaPublisher,
    ReplicaState,
    Router,
    RouterConfig,
    RoutingError,
    TablesUnavailable,
    request_block_hashes,
)
from ember_platform.routing.redis_tables import RedisTables

BLOCK = 16


def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except RoutingError:  # Redis down, or the replicas not back yet
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.02)


def test_tables_rebuild_after_a_redis_restart(own_redis, namespace: str, scorer_host: PluginHost) -> None:
    def connect() -> RedisTables:
        return RedisTables.from_url(own_redis.url, namespace=namespace, timeout_s=0.5)

    chain = request_block_hashes(list(range(40 * BLOCK)), BLOCK)
    pubs = [ReplicaPublisher(connect(), replica_id=rid, model="m", url=f"http://{rid}", block_size=BLOCK,
                             load=lambda: ReplicaLoad(max_num_seqs=8), state=ReplicaState.READY,
                             heartbeat_s=0.1, ttl_s=1.0)
            for rid in ("r1", "r2")]
    pubs[1].record_kv_events(stored=chain, removed=[])
    pubs[1].set_adapters({"sql"})
    for pub in pubs:
        pub.start()
    gateways = [Router.from_config(connect(), RouterConfig(), host=scorer_host) for _ in range(2)]
    try:
        def routed_by_cache() -> bool:
            with gateways[0].choose("m", chain, lora=None) as r:
                return r.replica_id == "r2" and r.num_cached_blocks == len(chain)

        # Both replicas in the tables before the crash: a publisher whose first heartbeat was still on its way (a
        # loaded machine) would register only after the restart, resync once, and never count a second resync.
        wait_for(lambda: routed_by_cache() and len(gateways[1].tables.snapshot("m")) == 2
                 and all(pub.num_resyncs >= 1 for pub in pubs), timeout=10)
        resyncs = [pub.num_resyncs for pub in pubs]
        epoch = gateways[1].tables.client.get(f"{namespace}epoch")  # type: ignore[attr-defined]
        held = gateways[1].choose("m", chain)

        own_redis.kill()
        with pytest.raises(TablesUnavailable):
            gateways[0].choose("m", chain)
        own_redis.start()  # same port, empty: no persistence

        # Neither the gateways nor the publishers were restarted: their clients reconnect on their own, the next
        # heartbeats re-register both replicas and each resends its whole block set.
        # A publisher counts its resync once it has resent its blocks, just after its heartbeat re-registered it:
        # wait for the count too, not only for both replicas to be back.
        wait_for(lambda: routed_by_cache() and len(gateways[1].tables.snapshot("m")) == 2
                 and all(pub.num_resyncs > before for pub, before in zip(pubs, resyncs, strict=True)),
                 timeout=15)  # generous: CI shares 2 cores
        assert gateways[1].tables.client.get(f"{namespace}epoch") not in (None, epoch)  # type: ignore[attr-defined]
        assert gateways[1].tables.snapshot("m", chain)[1].record.adapters == {"sql"}
        held.release()  # a reservation the restart forgot: releasing it is harmless
        assert gateways[0].tables.snapshot("m")[1].num_in_flight == 0
    finally:
        for pub in pubs:
            pub.close()
        for gateway in gateways:
            gateway.tables.close()
