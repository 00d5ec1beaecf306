"""The request path: ready replicas for a request, waiting in a bounded queue for one when none is ready (a cold start
starts one, sleeping ones wake), a 503 with Retry-After while restarts back off; and what requests report back
(a replica answered 503, or could not be reached)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection

from ember.launch import LaunchState
from ember_platform.control.core import PlaneCore, retrieve
from ember_platform.control.deployments import Deployment, Replica, ReplicaState
from ember_platform.control.errors import DeploymentNotFound, NoReplicaAvailable, QueueFull


class RequestAdmission(PlaneCore):
    """What the gateway asks of the control plane for each request."""

    async def acquire(self, name: str, *, exclude: Collection[str] = (), timeout: float | None = None,
                      admitted: bool = False) -> list[Replica]:
        """Ready replicas of NAME (none of `exclude`, by id), waiting for one in NAME's bounded queue if needed.

        A deployment scaled to zero starts a replica for the first waiting request (a cold start); one whose
        replicas died waits for their replacements. `admitted`: the caller holds a place in the gateway's admission
        gate (gateway/admission.py), which bounded it already, so NAME's queue bound is not applied a second time.
        Raises DeploymentNotFound, QueueFull, or NoReplicaAvailable after `timeout` (default: `wait_timeout`), or at
        once while NAME's replicas keep failing and the next restart waits out its backoff (backoff.py).
        """
        dep = self.get(name)

        def candidates() -> list[Replica]:
            return [r for r in dep.ready_replicas() if r.id not in exclude]

        if found := candidates():
            return found
        if sleepers := [r for r in dep.sleeping_replicas() if r.id not in exclude]:
            return self._wake(dep, sleepers)
        if not admitted and dep.waiting >= dep.max_queue:
            raise QueueFull(f"{name}: {dep.waiting} requests are already waiting for a replica (max_queue = "
                            f"{dep.max_queue}); retry shortly", retry_after=1.0)
        timeout = self.wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        dep.waiting += 1
        try:
            self.ensure_replica(dep)
            while True:
                changed = dep.changed_event()
                if dep.deleted:
                    raise DeploymentNotFound(name, self._deployments)
                if found := candidates():
                    return found
                if (refusal := self._backing_off(dep)) is not None:
                    raise refusal
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._unavailable(dep, timeout)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        finally:
            dep.waiting -= 1

    def ensure_replica(self, dep: Deployment) -> None:
        """A request waits for a replica of `dep`: wake its sleeping replicas, or start one for a deployment scaled to
        zero (a cold start), or replace the ones that died now rather than at the next supervision round.

        Raises NoReplicaAvailable (503 with Retry-After) while `dep`'s replicas keep failing and the next restart
        waits out its backoff: nothing could answer the request before then."""
        if dep.deleted or dep.ready_replicas():
            return
        if sleepers := dep.sleeping_replicas():
            self._wake(dep, sleepers)
            return
        if dep.desired == 0:
            dep.desired = 1
            dep.log("cold start: a request arrived while no replica was running")
        self._reconcile(dep)
        if (refusal := self._backing_off(dep)) is not None:
            raise refusal

    def report_unavailable(self, dep: Deployment, replica: Replica) -> None:
        """A replica answered 503 (it is draining or not ready): route around it until a probe says it is ready."""
        if replica.state is ReplicaState.READY:
            replica.state = ReplicaState.DRAINING
            dep.log(f"replica {replica.id} answered 503: draining")
            dep.notify()
            self._reconcile(dep)

    def report_unreachable(self, dep: Deployment, replica: Replica) -> None:
        """A connection to the replica failed: route around it at once, and if the launcher says it exited, replace
        it now rather than at the next probe (one that still runs is ready again at its next good probe)."""
        if replica.handle is None or replica.local_url is None:
            return
        if replica.state is ReplicaState.READY:
            replica.state = ReplicaState.DRAINING
            dep.notify()
        task = asyncio.create_task(self._bury_if_exited(dep, replica), name=f"ember-unreachable-{replica.id}")
        task.add_done_callback(retrieve)

    async def _bury_if_exited(self, dep: Deployment, replica: Replica) -> None:
        status = await self.launcher.status(replica.handle)
        if status.state is LaunchState.EXITED and replica.state is not ReplicaState.DEAD:
            self._bury(dep, replica, status.exit_code)
            self._reconcile(dep)

    def _backing_off(self, dep: Deployment) -> NoReplicaAvailable | None:
        """The answer for a request while nothing runs and the next restart waits out its backoff, else None."""
        wait = dep.backoff.remaining(time.monotonic())
        if wait <= 0 or dep.live_replicas() or dep.sleeping_replicas():
            return None
        return NoReplicaAvailable(f"No replica of '{dep.name}' is running: its replicas failed "
                                  f"{dep.backoff.failures} times in a row (last: {dep.backoff.last_failure}), and the "
                                  f"next one starts in {wait:.1f} s. Please retry then.", retry_after=wait)

    def _unavailable(self, dep: Deployment, waited: float) -> NoReplicaAvailable:
        counts = dep.state_counts()
        states = ", ".join(f"{n} {state}" for state, n in counts.items() if n) or "none running"
        reason = f"; last error: {dep.last_error.splitlines()[0]}" if dep.last_error else ""
        return NoReplicaAvailable(f"No replica of '{dep.name}' could take the request within {waited:.0f} s "
                                  f"(replicas: {states}){reason}. Please retry shortly.", retry_after=5.0)

    def _wake(self, dep: Deployment, sleepers: list[Replica]) -> list[Replica]:
        """Sleeping replicas take requests again at once: their engines reallocate the KV cache on the first one."""
        for replica in sleepers:
            replica.state = ReplicaState.READY
        dep.desired, dep.sleeping_since = len(dep.live_replicas()), None
        dep.log(f"woke {len(sleepers)} sleeping replica(s) for a request")
        dep.notify()
        return sleepers
