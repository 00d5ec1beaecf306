"""Supervision: start replicas through the launcher until each deployment runs as many as it should, follow their
readiness and liveness every probe interval, and replace those that fail, with a crash-loop backoff for those that
keep failing (backoff.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from ember.launch import LaunchError, LaunchState, ReplicaSpec, Resources
from ember_platform.control.core import PlaneCore, retrieve
from ember_platform.control.deployments import Deployment, Replica, ReplicaState
from ember_platform.replica.auth import auth_headers, new_secret
from ember_platform.replica.core import FAILED

logger = logging.getLogger("ember.control")

# A replica whose engine died exits by itself once nothing is in flight (replica/server.py); past this, it is killed.
FAILED_GRACE_S = 3.0
STATUS_POLL_S = 0.05  # how often a starting replica's launch status is read


class Supervision(PlaneCore):
    """Replicas in and out: launch, reconcile, probe, bury, replace."""

    def _reconcile(self, dep: Deployment) -> list[asyncio.Task[Replica]]:
        """Start replicas of the active version until `desired` are starting or ready. Returns the starts."""
        if dep.deleted or self._closing:
            return []
        missing = dep.desired - len(dep.live_replicas())
        if missing <= 0:
            return []
        wait = dep.backoff.remaining(time.monotonic())
        if wait > 0:  # replicas keep failing: the next one starts when the backoff ends, not at the next probe
            if dep.name not in self._restart_timers:
                self._restart_timers[dep.name] = asyncio.get_running_loop().call_later(wait, self._backoff_over, dep)
            return []
        if dep.backoff.failures:
            dep.backoff.restarted()
            dep.log(f"restarting: {missing} replacement(s) after {dep.backoff.failures} failure(s) in a row "
                    f"(restart {dep.backoff.restarts})")
        return [self._launch(dep, dep.active_version) for _ in range(missing)]

    def _backoff_over(self, dep: Deployment) -> None:
        self._restart_timers.pop(dep.name, None)
        if not self._lock(dep.name).locked():  # an operation in progress owns the replica count
            self._reconcile(dep)

    def _failed(self, dep: Deployment, replica: Replica, reason: str) -> None:
        """A replica of `dep` failed on its own: count it towards the crash-loop backoff of its replacement."""
        if replica.version != dep.active_version or dep.deleted:
            return  # a new version's replica that failed to start fails its operation instead
        delay = dep.backoff.failed(self.restart_backoff, reason, time.monotonic())
        dep.last_error = reason
        if delay > 0:
            dep.log(f"crash-loop backoff: {dep.backoff.failures} failures in a row; the next replica starts in "
                    f"{delay:.1f} s")
            logger.warning("%s: %d replica failures in a row; restarting in %.1f s", dep.name, dep.backoff.failures,
                           delay)

    def _launch(self, dep: Deployment, version: str) -> asyncio.Task[Replica]:
        replica = Replica(version=version)
        dep.replicas.append(replica)
        self.states.launched(dep, replica.id)
        dep.notify()
        task = asyncio.create_task(self._start_replica(dep, replica), name=f"ember-start-{dep.name}-{replica.id}")
        self._launching[replica.id] = task
        task.add_done_callback(lambda _: self._launching.pop(replica.id, None))
        task.add_done_callback(retrieve)
        return task

    def _spec(self, dep: Deployment, replica: Replica) -> ReplicaSpec:
        """What the launcher is asked to start: the registry reference and digest (never a local path), the engine
        overrides, the devices it needs, and the secret it must require."""
        version = dep.versions[replica.version]
        manifest = version.manifest
        # Devices it must own: its parallel world size when the package asks for CUDA; "auto" takes what it finds.
        world = manifest.parallelism.tensor_parallel * manifest.parallelism.expert_parallel
        gpus = world if manifest.runtime.accelerator == "cuda" else 0
        return ReplicaSpec(deployment=dep.name, version=replica.version, digest=version.digest,
                           registry_url=self.registry.url,
                           registry_endpoint_url=getattr(self.registry, "endpoint_url", None),
                           replica_id=replica.id, secret=self.replica_secret or new_secret(),
                           overrides=dict(dep.overrides), resources=Resources(gpus=gpus), role="both")

    async def _start_replica(self, dep: Deployment, replica: Replica) -> Replica:
        started = time.monotonic()
        try:
            spec = self._spec(dep, replica)
            replica.local_secret = spec.secret
            replica.handle = await self.launcher.start(spec)
            replica.local_url = await asyncio.wait_for(self._running(replica.handle), self.start_timeout)
            replica.launch_info = dict(self.launcher.describe(replica.handle))
        except BaseException as e:
            replica.state = ReplicaState.DEAD
            if replica in dep.replicas:
                dep.replicas.remove(replica)
            if replica.handle is not None:  # started, then failed, timed out or was cancelled: gone for good
                with contextlib.suppress(Exception):
                    await self.launcher.stop(replica.handle, 0)
            if isinstance(e, TimeoutError):
                e = LaunchError(f"replica was not running within {self.start_timeout:.0f} s")
            if isinstance(e, Exception):
                self._failed(dep, replica, f"replica failed to start: {str(e).splitlines()[0]}")
                dep.last_error = f"replica failed to start: {e}"
                dep.log(f"replica {replica.id} ({replica.version}) failed to start: {str(e).splitlines()[0]}")
                logger.error("%s: replica %s failed to start: %s", dep.name, replica.id, e)
            dep.notify()
            if isinstance(e, LaunchError):
                raise e from None
            raise
        replica.start_s = time.monotonic() - started
        if replica.stopping or dep.deleted or self._closing:  # retired while it was starting
            await self.launcher.stop(replica.handle, 0)
            self._bury(dep, replica)
            return replica
        replica.state = ReplicaState.READY
        replica.ready_at = time.monotonic()
        dep.log(f"replica {replica.id} ({replica.version}) ready at {replica.url} in {replica.start_s:.1f} s")
        dep.notify()
        return replica

    async def _running(self, handle: object) -> str:
        """The URL of a started replica once the launcher says it runs; LaunchError when it exited first."""
        while True:
            status = await self.launcher.status(handle)
            if status.state is LaunchState.RUNNING and status.url:
                return status.url
            if status.state is LaunchState.EXITED:
                raise LaunchError(status.reason or f"replica exited with code {status.exit_code} before it was ready")
            await asyncio.sleep(STATUS_POLL_S)

    def _retire(self, dep: Deployment, replica: Replica, *, grace: float | None = None) -> asyncio.Task[None]:
        """Drain and stop one replica (once, however often it is asked); it takes no new requests from now on.

        `grace`: seconds the drain may take before the process is killed (default: the launcher's drain timeout)."""
        task = self._retiring.get(replica.id)
        if task is None:
            replica.stopping = True
            task = asyncio.create_task(self._stop_replica(dep, replica, grace), name=f"ember-stop-{replica.id}")
            self._retiring[replica.id] = task
            task.add_done_callback(lambda _: self._retiring.pop(replica.id, None))
            task.add_done_callback(retrieve)
        return task

    async def _stop_replica(self, dep: Deployment, replica: Replica, grace: float | None = None) -> None:
        task = self._launching.get(replica.id)
        if task is not None and not task.done():  # still starting: cancel the start, which stops what it started
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return
        if replica.handle is None:
            return
        if replica.state is not ReplicaState.DEAD:
            replica.state = ReplicaState.DRAINING
            dep.notify()
            await self.launcher.stop(replica.handle, grace)
        self._bury(dep, replica)

    def _bury(self, dep: Deployment, replica: Replica, code: int | None = None) -> None:
        """`replica` is gone (stopped by us, or exited by itself with `code`): forget it."""
        if replica in dep.replicas:
            dep.replicas.remove(replica)
            if not replica.stopping:
                dep.log(f"replica {replica.id} ({replica.version}) exited by itself (code {code})")
                logger.warning("%s: replica %s at %s exited (code %s)", dep.name, replica.id, replica.url, code)
                self._failed(dep, replica, f"replica {replica.id} exited by itself (code {code})")
        replica.state = ReplicaState.DEAD
        dep.notify()

    async def _supervise(self) -> None:
        """Every probe interval: bury replicas whose process exited, follow each replica's readiness (a replica
        SIGTERMed from outside starts draining), and start replacements."""
        while True:
            await asyncio.sleep(self.probe_interval)
            for dep in list(self._deployments.values()):
                try:
                    await self._check(dep)
                except Exception:  # a bug here must not stop supervision of every other deployment
                    logger.exception("%s: supervising failed", dep.name)

    async def _check(self, dep: Deployment) -> None:
        running = [r for r in dep.replicas if r.local_url is not None and r.state is not ReplicaState.DEAD]
        for replica, status in zip(running, await asyncio.gather(*(self.launcher.status(r.handle) for r in running)),
                                   strict=True):
            if status.state is LaunchState.EXITED and replica.state is not ReplicaState.DEAD:
                self._bury(dep, replica, status.exit_code)
        probed = [r for r in dep.replicas if r.local_url is not None and not r.stopping
                  and r.state in (ReplicaState.READY, ReplicaState.DRAINING)]
        await asyncio.gather(*(self._probe(dep, r) for r in probed))
        ready_since = min((r.ready_at for r in dep.ready_replicas() if r.ready_at is not None), default=None)
        if dep.backoff.forgive(self.restart_backoff, ready_since, time.monotonic()):
            dep.log(f"a replica stayed ready for {self.restart_backoff.reset_after_s:.0f} s: failures forgiven")
        if not self._lock(dep.name).locked():  # an operation in progress owns the replica count
            self._autoscale(dep)
            self._reconcile(dep)

    def _replace_failed(self, dep: Deployment, replica: Replica, failure: str) -> None:
        """A replica that can never serve again (its engine died): kill it after a short grace, whatever it holds
        (its requests failed with its engine), and start its replacement now rather than once it is gone."""
        # What failed (an exception's text) goes to the log only: last_error and the events reach response bodies.
        self._failed(dep, replica, f"replica {replica.id}'s engine failed")
        dep.log(f"replica {replica.id} ({replica.version}) failed: its engine stopped; stopping it, starting a "
                "replacement")
        logger.error("%s: replica %s at %s failed: %s; replacing it", dep.name, replica.id, replica.url, failure)
        self._retire(dep, replica, grace=FAILED_GRACE_S)
        self._reconcile(dep)

    async def _probe(self, dep: Deployment, replica: Replica) -> None:
        assert self._probe_client is not None and replica.url is not None
        try:
            response = await self._probe_client.get(f"{replica.url}/ready", headers=auth_headers(replica.secret))
        except httpx.HTTPError:
            return  # a busy replica may answer late; a dead one is found by its process
        ready = response.status_code == 200
        if replica.stopping or replica.state is ReplicaState.DEAD:
            return
        if not ready and (failure := _failure(response)) is not None:
            self._replace_failed(dep, replica, failure)
        elif ready and replica.state is ReplicaState.DRAINING:
            replica.state = ReplicaState.READY
            dep.log(f"replica {replica.id} is ready again")
            dep.notify()
        elif not ready and replica.state is ReplicaState.READY:
            replica.state = ReplicaState.DRAINING
            dep.log(f"replica {replica.id} reports not ready ({response.status_code}): draining")
            dep.notify()


def _failure(response: httpx.Response) -> str | None:
    """Why a replica's /ready says it failed (its engine died), or None when it is only not ready yet, or draining."""
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("status") != FAILED:
        return None
    return str(body.get("error") or "its engine stopped")
