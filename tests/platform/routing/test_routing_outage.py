"""A gateway's KV-aware chooser over a Redis that stops answering (SIGSTOP: hung, not refusing connections): the
event loop never waits on it, a request waits for one timeout at most, in a worker thread, and the ones after it
route on the gateway's own view at once until the backoff ends."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

from ember.manifest import load_manifest
from ember.plugins import PluginHost
from ember_platform.control.deployments import Deployment, DeploymentVersion, PullRecord, Replica, ReplicaState
from ember_platform.gateway.routing import REMOTE_REFRESH_S, KVAwareChooser
from ember_platform.routing import ReplicaLoad, ReplicaRecord, Router, RouterConfig
from ember_platform.routing.redis_tables import RedisTables

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
BODY = json.dumps({"model": "tiny-llama", "prompt": "def fibonacci(n):\n" * 8, "max_tokens": 4}).encode()


def deployment() -> tuple[Deployment, Replica]:
    manifest = load_manifest(EXAMPLE)
    version = DeploymentVersion(manifest.model.version, "sha256:test", EXAMPLE, manifest,
                                PullRecord(0.0, 0.0, 0, 0, 0, reused=True))
    dep = Deployment(name="tiny-llama", active_version=version.version, versions={version.version: version})
    local = Replica(version=version.version, state=ReplicaState.READY, remote_url="http://127.0.0.1:9")
    dep.replicas.append(local)
    return dep, local


def test_a_hung_redis_never_blocks_the_event_loop(own_redis, namespace: str, scorer_host: PluginHost) -> None:  # type: ignore[no-untyped-def]
    dep, local = deployment()
    replica_side = RedisTables.from_url(own_redis.url, namespace=namespace)
    replica_side.heartbeat(ReplicaRecord("remote", dep.name, "http://127.0.0.1:8", version=dep.active_version,
                                         load=ReplicaLoad(max_num_seqs=8)), incarnation="i", epoch=None, ttl_s=600)
    tables = RedisTables.from_url(own_redis.url, namespace=namespace, timeout_s=0.3)
    chooser = KVAwareChooser(Router.from_config(tables, RouterConfig(), host=scorer_host), observe_routing=False)

    async def scenario() -> float:
        remote = chooser.remote_candidates(dep)  # a model's first request reads the tables (Redis still fine)
        assert [r.id for r in remote] == ["remote"]
        await chooser.achoose(dep, [local, *remote], BODY, "before")
        gaps: list[float] = []

        async def tick() -> None:  # how long the event loop goes without running this
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        own_redis.process.send_signal(signal.SIGSTOP)
        try:
            chooser.release("before")
            await asyncio.sleep(REMOTE_REFRESH_S * 2)
            assert [r.id for r in chooser.remote_candidates(dep)] == ["remote"]  # last list, refreshed in background
            t0 = time.monotonic()
            await chooser.achoose(dep, [local, *remote], BODY, "during")  # runs into the timeout, in a thread
            first = time.monotonic() - t0
            t0 = time.monotonic()
            for i in range(5):
                replica = await chooser.achoose(dep, [local, *remote], BODY, f"after-{i}")
                assert replica in (local, *remote)
                chooser.release(f"after-{i}")
            assert time.monotonic() - t0 < 0.5  # backing off: no request waits on the tables again
            assert first < 5.0  # one read timing out with its retries (4 x 0.3 s here), not a hang
        finally:
            own_redis.process.send_signal(signal.SIGCONT)
            ticker.cancel()
        return max(gaps)

    worst_gap = asyncio.run(scenario())
    assert worst_gap < 0.5, f"the event loop stalled {worst_gap:.2f} s on the hung Redis"  # one blocking call: >1 s
    tables.close()
    replica_side.close()


def test_a_response_s_first_bytes_end_its_pending_prefill(scorer_host: PluginHost) -> None:
    """With the load scorer pricing pending prefill, a reservation's prompt counts against its replica until the
    gateway sees the first bytes of the response (`prefilled`), not until the response ends."""
    from ember_platform.routing.memory import InProcessTables

    dep, local = deployment()
    tables = InProcessTables()
    config = RouterConfig.from_mapping({"options": {"load": {"pending_cost": 1.0}}})
    chooser = KVAwareChooser(Router.from_config(tables, config, host=scorer_host), observe_routing=True)

    async def scenario() -> None:
        await chooser.achoose(dep, [local], BODY, "r1")
        reservation = chooser._reservations["r1"]
        assert reservation.pending_work > 0  # nothing cached: the whole prompt is pending
        assert tables._replicas[local.id].work == {reservation.token: reservation.pending_work}
        chooser.prefilled("r1")
        assert tables._replicas[local.id].work == {}
        assert local.id in {v.replica_id for v in tables.snapshot(dep.name) if v.num_in_flight == 1}  # still held
        chooser.release("r1")

    asyncio.run(scenario())


def test_a_package_without_max_model_len_routes_on_its_prompt(scorer_host: PluginHost) -> None:
    """The routing bound on prompt length falls back to a default when the manifest leaves the context to the
    checkpoint (it was `None * 16`: a TypeError, a 500 for every request)."""
    from ember_platform.routing.memory import InProcessTables

    dep, local = deployment()
    runtime = dep.active.manifest.runtime
    dep.active.manifest.runtime = runtime.model_copy(update={"max_model_len": None})
    chooser = KVAwareChooser(Router.from_config(InProcessTables(), RouterConfig(), host=scorer_host),
                             observe_routing=True)

    async def scenario() -> None:
        assert await chooser.achoose(dep, [local], BODY, "r1") is local
        chooser.release("r1")

    asyncio.run(scenario())
