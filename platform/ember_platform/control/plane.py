"""`ControlPlane`: deploys registry packages as replicas, switches versions without dropping requests, supervises.

Everything runs on the gateway's event loop. Operations on one deployment (deploy, promote, rollback, delete) take
its lock, so they happen one at a time; requests never take it: they only wait for a ready replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
import uuid
from collections.abc import Collection, Mapping
from pathlib import Path

import httpx

from ember.errors import PackageError
from ember.manifest import load_manifest
from ember.package.lock import LOCK_NAME, Lock
from ember.registry import BlobCache, Registry, parse_reference, pull_package, resolve, short_digest
from ember_platform.control.autoscaler import ScaleMemory, ScalingPolicy, decide
from ember_platform.control.backoff import BackoffPolicy
from ember_platform.control.deployments import (
    Deployment,
    DeploymentVersion,
    PullRecord,
    Replica,
    ReplicaState,
)
from ember_platform.control.launcher import Launcher
from ember_platform.control.state import DeploymentStates
from ember_platform.replica.app import FAILED
from ember_platform.replica.auth import auth_headers
from ember_platform.routing import DeploymentState, RoutingTables
from ember_platform.routing.memory import InProcessTables

logger = logging.getLogger("ember.control")

PROBE_TIMEOUT_S = 2.0
# A replica whose engine died exits by itself once nothing is in flight (replica/server.py); past this, it is killed.
FAILED_GRACE_S = 3.0


class ControlError(Exception):
    """An operation or a request the control plane refuses; `status` is the HTTP status the gateway answers."""

    status = 500

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class InvalidDeployment(ControlError):
    status = 400


class DeploymentNotFound(ControlError):
    status = 404

    def __init__(self, name: str, available: Collection[str]) -> None:
        listed = f"deployed: {', '.join(sorted(available))}" if available else "nothing is deployed"
        super().__init__(f"no deployment named {name!r} ({listed})")
        self.name = name
        self.available = sorted(available)


class VersionNotFound(ControlError):
    status = 404


class Conflict(ControlError):
    status = 409


class DeployError(ControlError):
    """A replica of the new version did not start; the deployment is as it was."""

    status = 502


class QueueFull(ControlError):
    status = 429


class NoReplicaAvailable(ControlError):
    status = 503


class ControlPlane:
    """Deployments by name. Call `start()` on the running loop before use, and `shutdown()` at the end."""

    def __init__(self, registry: Registry, *, packages_dir: Path, launcher: Launcher, cache: BlobCache | None = None,
                 probe_interval: float = 1.0, restart_backoff: BackoffPolicy | None = None,
                 wait_timeout: float = 120.0, routing_tables: RoutingTables | None = None) -> None:
        """`routing_tables`: where each deployment's state (cold, starting, warm, sleeping) is written, the tables
        the gateway routes with (shared with other gateways through Redis); in-process tables of its own otherwise.
        `restart_backoff`: how long replacements of replicas that keep failing wait (control/backoff.py).
        """
        self.registry = registry
        self.packages_dir = Path(packages_dir)
        self.launcher = launcher
        self.cache = cache or BlobCache.default()
        self.probe_interval = probe_interval
        self.restart_backoff = restart_backoff or BackoffPolicy()
        self.wait_timeout = wait_timeout  # longest a request waits for a ready replica (e.g. a cold start)
        self._deployments: dict[str, Deployment] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._launching: dict[str, asyncio.Task[Replica]] = {}  # replica id -> its start
        self._retiring: dict[str, asyncio.Task[None]] = {}      # replica id -> its drain and stop
        self._restart_timers: dict[str, asyncio.TimerHandle] = {}  # deployment -> its reconcile when backoff ends
        self._scale_memory: dict[str, ScaleMemory] = {}           # deployment -> the autoscaler's memory
        self._supervisor: asyncio.Task[None] | None = None
        self._probe_client: httpx.AsyncClient | None = None
        self._closing = False
        self.states = DeploymentStates(routing_tables or InProcessTables(), interval=probe_interval)

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._probe_client = httpx.AsyncClient(timeout=PROBE_TIMEOUT_S)
        self._supervisor = asyncio.create_task(self._supervise(), name="ember-supervisor")
        self.states.start(lambda: list(self._deployments.values()))

    async def shutdown(self) -> None:
        """Drain and stop every replica (each bounded by the launcher's drain timeout), then stop supervising."""
        self._closing = True
        for timer in self._restart_timers.values():
            timer.cancel()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        stops = []
        for dep in self._deployments.values():
            dep.deleted, dep.desired = True, 0
            stops += [self._retire(dep, replica) for replica in list(dep.replicas)]
            dep.notify()
        await asyncio.gather(*stops, *self._retiring.values(), return_exceptions=True)
        await self.states.close(list(self._deployments.values()))  # cold now, unless other gateways serve them
        if self._probe_client is not None:
            await self._probe_client.aclose()

    # --- queries ------------------------------------------------------------------------------------------

    def get(self, name: str) -> Deployment:
        try:
            return self._deployments[name]
        except KeyError:
            raise DeploymentNotFound(name, self._deployments) from None

    def list(self) -> list[Deployment]:
        return [self._deployments[name] for name in sorted(self._deployments)]

    def names(self) -> list[str]:
        return sorted(self._deployments)

    async def deployment_state(self, dep: Deployment) -> tuple[DeploymentState, str]:
        """The deployment's state (cold, starting, warm, sleeping) as the routing tables hold it (with Redis, as
        every gateway sees it), and where that came from."""
        return await self.states.read(dep)

    # --- operations ---------------------------------------------------------------------------------------

    async def deploy(self, reference: str, *, min_replicas: int | None = None, max_replicas: int | None = None,
                     overrides: Mapping[str, str] | None = None) -> Deployment:
        """Pull NAME[:VERSION] (the latest when no version is given) and make it the active version: its replicas
        start and become ready first, then the previous version's drain. Deploying the active version again
        applies new replica counts."""
        name, _ = parse_reference(reference)
        if min_replicas is not None and max_replicas is not None and min_replicas > max_replicas:
            raise InvalidDeployment(f"min_replicas ({min_replicas}) must not exceed max_replicas ({max_replicas})")
        async with self._lock(name):
            pulled = await asyncio.to_thread(self._pull, reference)
            dep = self._deployments.get(name)
            if dep is None:
                dep = Deployment(name=name, active_version=pulled.version, on_change=self.states.changed)
                dep.versions[pulled.version] = pulled
                self._configure(dep, min_replicas, max_replicas, overrides)
                await self._create(dep)
                return dep
            known = dep.versions.get(pulled.version)
            if known is not None and known.digest != pulled.digest:
                raise Conflict(f"{name}:{pulled.version} changed in the registry since it was deployed "
                               f"({short_digest(known.digest)} -> {short_digest(pulled.digest)}); versions are "
                               "immutable: publish the change under a new version")
            added = known is None
            dep.versions.setdefault(pulled.version, pulled)
            settings = (dep.min_replicas, dep.max_replicas, dep.overrides, dep.desired)
            self._configure(dep, min_replicas, max_replicas, overrides)
            try:
                if pulled.version == dep.active_version:
                    await self._rescale(dep)
                else:
                    await self._switch(dep, pulled.version, remember=True)
            except BaseException:  # a failed deploy changes nothing
                dep.min_replicas, dep.max_replicas, dep.overrides, dep.desired = settings
                if added:
                    del dep.versions[pulled.version]
                raise
            return dep

    async def promote(self, name: str, version: str) -> Deployment:
        """Make an already deployed VERSION active again (its replicas start, then the current ones drain)."""
        async with self._lock(name):
            dep = self.get(name)
            if version not in dep.versions:
                raise VersionNotFound(f"{name} has no deployed version {version!r} (deployed: "
                                      f"{', '.join(sorted(dep.versions))}); deploy it first: "
                                      f"ember deploy {name}:{version}")
            if version != dep.active_version:
                await self._switch(dep, version, remember=True)
            return dep

    async def rollback(self, name: str) -> Deployment:
        """Go back to the version that was active before the current one."""
        async with self._lock(name):
            dep = self.get(name)
            if not dep.history:
                raise Conflict(f"{name} has no earlier version to roll back to (active: {dep.active_version})")
            version = dep.history.pop()
            try:
                await self._switch(dep, version, remember=False)
            except BaseException:
                dep.history.append(version)
                raise
            return dep

    async def delete(self, name: str) -> Deployment:
        """Stop routing to NAME at once, then drain and stop its replicas."""
        async with self._lock(name):
            dep = self.get(name)
            del self._deployments[name]
            dep.deleted, dep.desired = True, 0
            dep.log("deleted")
            retiring = [self._retire(dep, replica) for replica in list(dep.replicas)]
            dep.notify()
            await asyncio.gather(*retiring, return_exceptions=True)
            return dep

    # --- the request path ---------------------------------------------------------------------------------

    async def acquire(self, name: str, *, exclude: Collection[str] = (), timeout: float | None = None,
                      admitted: bool = False) -> list[Replica]:
        """Ready replicas of NAME (none of `exclude`, by id), waiting for one in NAME's bounded queue if needed.

        A deployment scaled to zero starts a replica for the first waiting request (a cold start); one whose
        replicas died waits for their replacements. `admitted`: the caller holds a place in the gateway's admission
        gate (gateway/admission.py), which bounded it already, so NAME's queue bound is not applied a second time.
        Raises DeploymentNotFound, QueueFull, or NoReplicaAvailable after `timeout` (default: `wait_timeout`).
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
        """A connection to the replica failed: if its process is gone, replace it now rather than at the next probe."""
        if replica.handle is not None and not self.launcher.alive(replica.handle):
            self._bury(dep, replica)
            self._reconcile(dep)

    # --- internals ----------------------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _pull(self, reference: str) -> DeploymentVersion:
        """Resolve, then pull once into packages/<name>/<version>/ through the blob cache (runs in a thread)."""
        start = time.monotonic()
        lock = resolve(self.registry, reference)
        resolved = time.monotonic()
        dest = self.packages_dir / lock.name / lock.version
        record = None
        existing = _read_lock(dest)
        if existing is not None and existing.digest == lock.digest:
            record = PullRecord(resolved - start, 0.0, 0, 0, len(lock.blobs()), reused=True)
        else:
            if dest.exists():  # a damaged or stale pull: replicas of it may still run from their open files
                stale = dest.with_name(f".{dest.name}.stale-{uuid.uuid4().hex[:8]}")
                dest.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            result = pull_package(lock.reference, self.registry, dest, self.cache)
            lock = result.lock
            record = PullRecord(resolved - start, time.monotonic() - resolved, result.downloaded_bytes,
                                len(result.downloaded), result.from_cache, reused=False)
        manifest = load_manifest(dest)
        logger.info("pulled %s (%s) into %s in %.2f s", lock.reference, short_digest(lock.digest), dest,
                    record.resolve_s + record.pull_s)
        return DeploymentVersion(lock.version, lock.digest, dest, manifest, record)

    @staticmethod
    def _configure(dep: Deployment, min_replicas: int | None, max_replicas: int | None,
                   overrides: Mapping[str, str] | None) -> None:
        if min_replicas is not None:
            dep.min_replicas = min_replicas
        if max_replicas is not None:
            dep.max_replicas = max_replicas
        if overrides is not None:
            dep.overrides = {str(k): str(v) for k, v in overrides.items()}

    async def _create(self, dep: Deployment) -> None:
        """A new deployment is routable at once (requests wait for its first replica); it is removed again when
        its replicas do not start."""
        self._deployments[dep.name] = dep
        dep.desired = dep.scaling().initial
        dep.log(f"deployed {dep.active_version} ({short_digest(dep.active.digest)}), {dep.desired} replica(s)")
        starts = self._reconcile(dep)
        results = await asyncio.gather(*starts, return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self._deployments.pop(dep.name, None)
            dep.deleted, dep.desired = True, 0
            await asyncio.gather(*(self._retire(dep, r) for r in list(dep.replicas)), return_exceptions=True)
            dep.notify()
            raise DeployError(f"{dep.name}:{dep.active_version}: {failure}") from failure

    async def _rescale(self, dep: Deployment) -> None:
        initial = dep.scaling().initial
        if initial == 0:  # a scale-to-zero deployment keeps what runs; the autoscaler removes idle replicas
            return
        dep.desired = initial
        dep.backoff.clear()
        live = dep.live_replicas()
        extra = live[initial:]
        starts = self._reconcile(dep)
        for replica in extra:
            self._retire(dep, replica)
        results = await asyncio.gather(*starts, return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise DeployError(f"{dep.name}:{dep.active_version}: {failure}") from failure
        dep.log(f"scaled to {initial} replica(s)")

    async def _switch(self, dep: Deployment, version: str, *, remember: bool) -> None:
        """Start VERSION's replicas, make it active once they are ready, then drain the others."""
        scaling = dep.scaling(version)
        # A scale-to-zero deployment that traffic has woken keeps as many replicas as it runs now.
        count = scaling.initial or min(dep.desired, scaling.max_replicas)
        starts = [self._launch(dep, version) for _ in range(count)]
        results = await asyncio.gather(*starts, return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            started = [r for r in results if isinstance(r, Replica)]
            await asyncio.gather(*(self._retire(dep, r) for r in started), return_exceptions=True)
            raise DeployError(f"{dep.name}:{version}: {failure}; {dep.active_version} stays active") from failure
        previous = dep.active_version
        if remember:
            dep.history.append(previous)
        dep.active_version, dep.desired = version, count
        dep.backoff.clear()
        dep.log(f"{version} is active ({short_digest(dep.active.digest)}); draining {previous}")
        dep.notify()
        for replica in list(dep.replicas):
            if replica.version != version:
                self._retire(dep, replica)

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

    def _backing_off(self, dep: Deployment) -> NoReplicaAvailable | None:
        """The answer for a request while nothing runs and the next restart waits out its backoff, else None."""
        wait = dep.backoff.remaining(time.monotonic())
        if wait <= 0 or dep.live_replicas() or dep.sleeping_replicas():
            return None
        return NoReplicaAvailable(f"No replica of '{dep.name}' is running: its replicas failed "
                                  f"{dep.backoff.failures} times in a row (last: {dep.backoff.last_failure}), and the "
                                  f"next one starts in {wait:.1f} s. Please retry then.", retry_after=wait)

    def _launch(self, dep: Deployment, version: str) -> asyncio.Task[Replica]:
        replica = Replica(version=version)
        dep.replicas.append(replica)
        self.states.launched(dep, replica.id)
        dep.notify()
        task = asyncio.create_task(self._start_replica(dep, replica), name=f"ember-start-{dep.name}-{replica.id}")
        self._launching[replica.id] = task
        task.add_done_callback(lambda _: self._launching.pop(replica.id, None))
        task.add_done_callback(_retrieve)
        return task

    async def _start_replica(self, dep: Deployment, replica: Replica) -> Replica:
        version = dep.versions[replica.version]
        started = time.monotonic()
        try:
            replica.handle = await self.launcher.start(version.package_dir, dep.overrides,
                                                       label=f"{dep.name}-{replica.version}-{replica.id}",
                                                       replica_id=replica.id)
        except BaseException as e:
            replica.state = ReplicaState.DEAD
            if replica in dep.replicas:
                dep.replicas.remove(replica)
            if isinstance(e, Exception):
                self._failed(dep, replica, f"replica failed to start: {str(e).splitlines()[0]}")
                dep.last_error = f"replica failed to start: {e}"
                dep.log(f"replica {replica.id} ({replica.version}) failed to start: {str(e).splitlines()[0]}")
                logger.error("%s: replica %s failed to start: %s", dep.name, replica.id, e)
            dep.notify()
            raise
        replica.start_s = time.monotonic() - started
        if replica.stopping or dep.deleted or self._closing:  # retired while it was starting
            await self.launcher.stop(replica.handle, graceful=False)
            self._bury(dep, replica)
            return replica
        replica.state = ReplicaState.READY
        replica.ready_at = time.monotonic()
        dep.log(f"replica {replica.id} ({replica.version}) ready at {replica.url} in {replica.start_s:.1f} s")
        dep.notify()
        return replica

    def _sleep(self, dep: Deployment, replica: Replica) -> None:
        replica.state = ReplicaState.SLEEPING
        if self._probe_client is not None and replica.url is not None:
            task = asyncio.create_task(self._post_sleep(dep, replica), name=f"ember-sleep-{replica.id}")
            task.add_done_callback(_retrieve)

    async def _post_sleep(self, dep: Deployment, replica: Replica) -> None:
        assert self._probe_client is not None
        try:
            response = await self._probe_client.post(f"{replica.url}/sleep", headers=auth_headers(replica.secret))
        except httpx.HTTPError as e:
            logger.info("%s: replica %s did not go to sleep (%s); it stays idle", dep.name, replica.id, e)
            return
        if response.status_code != 200:  # busy after all: it keeps its cache, which costs only memory
            logger.info("%s: replica %s refused to sleep: %s", dep.name, replica.id, response.text[:200])

    def _retire(self, dep: Deployment, replica: Replica, *, grace: float | None = None) -> asyncio.Task[None]:
        """Drain and stop one replica (once, however often it is asked); it takes no new requests from now on.

        `grace`: seconds the drain may take before the process is killed (default: the launcher's drain timeout)."""
        task = self._retiring.get(replica.id)
        if task is None:
            replica.stopping = True
            task = asyncio.create_task(self._stop_replica(dep, replica, grace), name=f"ember-stop-{replica.id}")
            self._retiring[replica.id] = task
            task.add_done_callback(lambda _: self._retiring.pop(replica.id, None))
            task.add_done_callback(_retrieve)
        return task

    async def _stop_replica(self, dep: Deployment, replica: Replica, grace: float | None = None) -> None:
        if replica.handle is None:  # still starting: cancel the start, which kills the process
            task = self._launching.get(replica.id)
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            return
        if replica.state is not ReplicaState.DEAD:
            replica.state = ReplicaState.DRAINING
            dep.notify()
            try:
                await asyncio.wait_for(self.launcher.stop(replica.handle, graceful=True), grace)
            except TimeoutError:
                logger.warning("%s: replica %s did not stop within %.0f s; killing it", dep.name, replica.id, grace)
                await self.launcher.stop(replica.handle, graceful=False)
        self._bury(dep, replica)

    def _bury(self, dep: Deployment, replica: Replica) -> None:
        if replica in dep.replicas:
            dep.replicas.remove(replica)
            if not replica.stopping:
                code = getattr(replica.handle.process, "returncode", None) if replica.handle else None
                dep.log(f"replica {replica.id} ({replica.version}) exited by itself (code {code})")
                logger.warning("%s: replica %s at %s exited (code %s)", dep.name, replica.id, replica.url, code)
                self._failed(dep, replica, f"replica {replica.id} exited by itself (code {code})")
        replica.state = ReplicaState.DEAD
        dep.notify()

    def _unavailable(self, dep: Deployment, waited: float) -> NoReplicaAvailable:
        counts = dep.state_counts()
        states = ", ".join(f"{n} {state}" for state, n in counts.items() if n) or "none running"
        reason = f"; last error: {dep.last_error.splitlines()[0]}" if dep.last_error else ""
        return NoReplicaAvailable(f"No replica of '{dep.name}' could take the request within {waited:.0f} s "
                                  f"(replicas: {states}){reason}. Please retry shortly.", retry_after=5.0)

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
        for replica in list(dep.replicas):
            if replica.handle is not None and replica.state is not ReplicaState.DEAD \
                    and not self.launcher.alive(replica.handle):
                self._bury(dep, replica)
        probed = [r for r in dep.replicas if r.handle is not None and not r.stopping
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

    def _wake(self, dep: Deployment, sleepers: list[Replica]) -> list[Replica]:
        """Sleeping replicas take requests again at once: their engines reallocate the KV cache on the first one."""
        for replica in sleepers:
            replica.state = ReplicaState.READY
        dep.desired, dep.sleeping_since = len(dep.live_replicas()), None
        dep.log(f"woke {len(sleepers)} sleeping replica(s) for a request")
        dep.notify()
        return sleepers

    def _autoscale(self, dep: Deployment) -> None:
        """Follow demand within [scaling]: start replicas at once, drain surplus ones after the idle delay; a
        deployment that scales to zero sleeps first (KV cache freed, weights kept) and stops after another delay."""
        scaling = dep.scaling()
        if dep.sleeping_since is not None:
            if dep.demand() == 0 and time.monotonic() - dep.sleeping_since >= scaling.scale_down_delay:
                for replica in dep.sleeping_replicas():
                    self._retire(dep, replica)
                dep.sleeping_since = None
                dep.log("autoscaler: asleep for the idle delay; scaled to zero")
                dep.notify()
            return
        policy = ScalingPolicy(scaling.min_replicas, scaling.max_replicas, scaling.target_concurrency,
                               scaling.scale_down_delay)
        memory = self._scale_memory.setdefault(dep.name, ScaleMemory())
        demand = dep.demand()
        desired = decide(policy, dep.desired, demand, time.monotonic(), memory)
        if desired == dep.desired:
            return
        if desired > dep.desired:
            dep.log(f"autoscaler: {demand} request(s) open or waiting; scaling up to {desired} replica(s)")
        elif desired == 0 and demand == 0 and all(r.state is ReplicaState.READY for r in dep.live_replicas()):
            # Idle and allowed to reach zero: sleep first, so a request in the next while wakes in a moment.
            for replica in dep.live_replicas():
                self._sleep(dep, replica)
            dep.sleeping_since = time.monotonic()
            dep.log(f"autoscaler: idle for {scaling.scale_down_delay:.0f} s; replicas sleep (KV cache freed)")
        else:
            # Surplus replicas drain (they finish what they hold); the least busy go first.
            live = sorted(dep.live_replicas(), key=lambda r: (r.in_flight, r.state is ReplicaState.READY))
            for replica in live[:max(0, len(live) - desired)]:
                self._retire(dep, replica)
            dep.log(f"autoscaler: {demand} request(s) for {scaling.scale_down_delay:.0f} s; scaling down to "
                    f"{desired} replica(s)" + (" (scaled to zero)" if desired == 0 else ""))
        dep.desired = desired
        dep.notify()

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


def _read_lock(package_dir: Path) -> Lock | None:
    try:
        return Lock.from_json((package_dir / LOCK_NAME).read_bytes(), source=str(package_dir / LOCK_NAME))
    except (OSError, PackageError):
        return None


def _retrieve(task: asyncio.Task[object]) -> None:
    """Mark a background task's exception as seen (it was logged or raised to an awaiting caller)."""
    if not task.cancelled():
        task.exception()
