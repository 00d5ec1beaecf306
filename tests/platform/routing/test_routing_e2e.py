"""Routing and elasticity end to end, through real processes: a real `redis-server`, two gateways (`ember serve
--redis-url`) and replica processes of the example model, the official `openai` client.

The topology of bench/bench_routing.py: gateway A deploys the example package with replicas that publish their
heartbeats, loads, KV blocks and LoRA adapters to Redis; gateway B has its own copy of the package scaled to zero,
starts no replica, and routes to A's replicas through the shared tables. Each test starts its own (the scenarios
kill things), on its own Redis (`own_redis`), with the tables' default lease: a heartbeat every second, 3 s TTL.
The gateways, their packages and the topology come from conftest.py (`start_topology`).

Which replica served a request is read from the replicas themselves (`ember_requests_finished_total` on each
replica's /metrics); a request a gateway sent to a replica it could not reach and then sent elsewhere is counted by
the gateway (`ember_gateway_upstream_retries_total`).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest

MODEL = "tiny-llama"
TTL_S = 3.0          # the replicas' lease (routing.publisher: 3 heartbeats of 1 s)
VOCAB = 4096


@pytest.fixture
def topology(start_topology: Callable[..., Any], request: pytest.FixtureRequest) -> Any:
    """Gateways A (`indirect` parameter: its number of replicas, default 2) and B (none) on `own_redis`."""
    return start_topology(replicas=getattr(request, "param", 2))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def complete(gateway: Any, prompt: list[int] | str, *, model: str = MODEL, max_tokens: int = 4) -> Any:
    return gateway.client().completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)


def cached(reply: Any) -> int:
    details = reply.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


# --- kill -9 of a replica ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("topology", [3], indirect=True)
def test_a_killed_replica_is_no_longer_chosen_once_its_lease_lapses(topology: Any,
                                                                    wait_until: Callable[..., Any]) -> None:
    a, b = topology.gateways
    urls = topology.routed()
    long_prefix = tokens(250, seed=1)            # 15 full blocks of 16 tokens
    longer = long_prefix + tokens(125, seed=2)   # 23 full blocks

    # The prefix goes to one replica; KV-aware routing sends it (and prompts that extend it) back there from either
    # gateway: B finds it through the blocks the replica published to Redis.
    before = topology.served_by(urls)
    complete(a, long_prefix)
    after = topology.served_by(urls)
    holder = next(rid for rid in urls if after[rid] == before[rid] + 1)
    assert cached(complete(b, longer)) == 15 * 16
    assert cached(complete(a, longer)) == 23 * 16
    assert topology.served_by(urls)[holder] == after[holder] + 2
    record = next(v.record for v in topology.tables.snapshot(MODEL) if v.replica_id == holder)
    blocks = topology.tables.blocks(holder)
    pid = next(r["pid"] for r in a.replicas() if r["id"] == holder)

    # kill -9: no drain, no goodbye to the tables. A thread watches the tables for the lease to lapse.
    lapsed: list[float] = []

    def watch() -> None:
        while time.monotonic() - killed_at < 30 and not lapsed:
            if holder not in {v.replica_id for v in topology.tables.snapshot(MODEL)}:
                lapsed.append(time.monotonic() - killed_at)
            time.sleep(0.02)

    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # Within the lease the tables still offer the dead replica, and it holds the prefix: requests for it may be sent
    # there first (by B until the lease lapses; by A until its control plane notices the exit). The connection is
    # refused before anything was sent, so the gateway sends the request to another replica: every one succeeds.
    for gateway in (b, a, b, a):
        assert complete(gateway, long_prefix).usage.completion_tokens == 4
    watcher.join(35)
    assert lapsed, f"replica {holder} still in the routing tables 30 s after kill -9"
    assert lapsed[0] <= TTL_S + 2.0, f"replica {holder} left the tables {lapsed[0]:.1f} s after kill -9"

    # The same moment made deterministic: the dead replica's record and blocks as its last heartbeat left them, with
    # a lease still running. B's router picks it (it alone holds all of `longer`), the connection is refused, and
    # B sends the request on: one retry, no error.
    topology.tables.heartbeat(record, incarnation="dead-replica-last-beat", epoch=None, ttl_s=60)
    topology.tables.replace_blocks(holder, blocks, ttl_s=60)
    retries = b.retries()
    reply = complete(b, longer)
    assert reply.usage.completion_tokens == 4
    assert b.retries() == retries + 1, b.log_tail()
    topology.tables.remove_replica(MODEL, holder)

    # After the lease: requests through both gateways all succeed, and none is sent to the dead replica (a gateway
    # counts every request it had to send elsewhere); the survivors (and A's replacement) serve them all.
    assert holder not in topology.routed()
    wait_until(lambda: holder not in {r["id"] for r in a.replicas()}, 10, "A's control plane to bury the replica")
    # A's control plane replaces the dead replica (desired: 3); wait for the replacement, so that the count of what the
    # replicas served below covers every one of them.
    wait_until(lambda: len(topology.routed()) == 3, 60, "A's replacement replica in the tables")
    live = topology.routed()
    assert holder not in live
    retries_before = {g.name: g.retries() for g in (a, b)}
    served_before = topology.served_by(live)
    prompts = [long_prefix, longer, tokens(64, seed=3), "def fibonacci(n):"]
    for i in range(8):
        gateway = (a, b)[i % 2]
        assert complete(gateway, prompts[i % len(prompts)]).usage.completion_tokens == 4
    assert {g.name: g.retries() for g in (a, b)} == retries_before
    served_after = topology.served_by(live)
    assert sum(served_after.values()) - sum(served_before.values()) == 8


# --- a Redis restart ----------------------------------------------------------------------------------------------


def test_gateways_and_replicas_reconnect_after_a_redis_restart(topology: Any, own_redis: Any,
                                                               wait_until: Callable[..., Any]) -> None:
    a, b = topology.gateways
    urls = topology.routed()
    prefix = tokens(250, seed=11)  # 15 full blocks
    complete(a, prefix)
    assert cached(complete(b, prefix)) == 15 * 16  # B routed it to the replica holding it: the tables work
    blocks_before = {rid: len(topology.tables.blocks(rid)) for rid in urls}
    holder = max(blocks_before, key=blocks_before.__getitem__)
    assert blocks_before[holder] >= 15
    infos = {g.name: g.info() for g in (a, b)}
    states = {name: (info["state"], info["state_source"]) for name, info in infos.items()}
    assert states == {"a": ("warm", "routing tables"), "b": ("warm", "routing tables")}  # A wrote it; B reads it
    assert topology.tables.stored_deployment_state(MODEL) == "warm"

    own_redis.kill()  # everything in it is lost: no persistence
    # While it is down, requests either succeed (A routes to its own replicas on load alone; B, which knows of no
    # replica without the tables, cold-starts one of its own) or are refused with 503 and Retry-After: never a 500,
    # never a hang.
    outage: list[str] = []
    for i, gateway in enumerate((a, b, a, b)):
        try:
            reply = gateway.client(timeout=120).completions.create(model=MODEL, prompt=f"def outage_{i}(x):",
                                                                   max_tokens=2, temperature=0)
            assert reply.usage.completion_tokens == 2
            outage.append("ok")
        except openai.APIStatusError as e:
            assert e.status_code == 503 and e.response.headers.get("retry-after"), (e.status_code, e.message)
            outage.append("503")
    assert outage[0] == "ok" and outage[2] == "ok"  # A serves with its own replicas
    assert a.info()["state_source"].startswith("this gateway's replicas")  # /info still answers

    own_redis.start()  # the same port, empty
    # Nobody restarted: the replicas' next heartbeats register them again and resend their whole block sets; A
    # writes the deployment state again; both gateways' clients reconnect by themselves.
    wait_until(lambda: set(urls) <= set(topology.routed()), 15, "A's replicas back in the tables")
    wait_until(lambda: len(topology.tables.blocks(holder)) >= blocks_before[holder], 15, "the block sets resent")
    wait_until(lambda: topology.tables.stored_deployment_state(MODEL) == "warm", 15, "A to write the state again")
    for gateway in (a, b):
        assert gateway.info()["state_source"] == "routing tables"
    # Prefix routing works again through either gateway, from the rebuilt tables (once a gateway's back-off after
    # the outage, gateway.routing.OUTAGE_BACKOFF_S, is over: it routes by load until then).
    for gateway in (b, a):
        wait_until(lambda g=gateway: cached(complete(g, prefix)) == 15 * 16, 20,
                   f"gateway {gateway.name} routing by prefix again", interval=0.5)
    for i in range(6):
        assert complete((a, b)[i % 2], f"def after_{i}(x):").usage.completion_tokens == 4
