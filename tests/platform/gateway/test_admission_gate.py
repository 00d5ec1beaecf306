"""The admission gate on its own, while a deployment's restarts back off: a request that would wait for a replica is
refused at once with the control plane's 503, and one already queued when the backoff starts is answered with it too
(it does not sit out its queue timeout), holding nothing afterwards."""

from __future__ import annotations

import asyncio

import pytest

from ember_platform.control.plane import NoReplicaAvailable
from ember_platform.gateway.admission import AdmissionGate, Limits

NO_REPLICA = Limits(running=0, queue=4, per_key=None, queue_timeout=60.0)


def test_requests_waiting_for_a_replica_get_the_backoff_503_at_once() -> None:
    backing_off = False
    changed = asyncio.Event()

    def on_wait() -> None:  # the control plane's ensure_replica: refuses while the next restart waits
        if backing_off:
            raise NoReplicaAvailable("its replicas failed 2 times in a row", retry_after=3.0)

    async def scenario() -> None:
        nonlocal backing_off, changed
        gate = AdmissionGate("m", lambda: NO_REPLICA, on_wait=on_wait, changed=lambda: changed)
        queued = asyncio.create_task(gate.admit("key"))  # a replica is starting: it waits in the queue
        await asyncio.sleep(0.05)
        assert gate.queued == 1 and gate.held_by("key") == 1

        backing_off = True  # the starting replica failed: the deployment backs off
        changed.set()
        changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(NoReplicaAvailable) as refused:
            await queued
        assert loop.time() - started < 0.5 and refused.value.retry_after == 3.0
        with pytest.raises(NoReplicaAvailable, match="2 times in a row"):
            await gate.admit("key")  # a new request is refused before it queues
        assert (gate.queued, gate.running, gate.held_by("key")) == (0, 0, 0)
        await gate.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 10))
