"""Admission control per deployment: a gate in front of the replicas that lets in as many requests as they can run,
queues the next `[serving] max_queue` in order, and turns the rest away at once (429 with Retry-After).

Without it every request went straight to an engine, whose own queue has no bound: under overload time to first
token grew without limit and nobody was refused (TGI's `max_concurrent_requests` and Baseten's concurrency target
shed the same way). The gate counts requests, not tokens: a replica runs `max_num_seqs` sequences at once, so the
deployment's running capacity is that summed over its ready replicas. With no ready replica (a cold start, or the
only replica died and its replacement is starting) the capacity is 0 and requests wait in the same bounded queue
until one is ready. A request that waits longer than the queue timeout gets a 503 with Retry-After. One API key may
hold at most `max_concurrency_per_key` places (running and waiting), so one client cannot fill the queue for all.

A `Ticket` holds a running place until `release()`, which is idempotent: the proxy calls it on every way a request
ends (finished, client gone, upstream error, stream cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember_platform.control.plane import NoReplicaAvailable, QueueFull

if TYPE_CHECKING:
    from ember_platform.control.deployments import Deployment
    from ember_platform.control.plane import ControlPlane

logger = logging.getLogger("ember.gateway")

FULL_RETRY_AFTER_S = 1.0       # the queue is full: places free up as fast as requests finish, often within a second
TIMEOUT_RETRY_AFTER_S = 5.0    # a request waited its whole queue timeout: the deployment is far behind
WATCH_INTERVAL_S = 1.0         # the longest a queued request waits to see a change in capacity it was not told of


@dataclass(frozen=True, slots=True)
class Limits:
    """What one deployment admits, read again for every request (replicas come and go, versions change)."""

    running: int          # requests that run at once: max_num_seqs summed over the ready replicas
    queue: int            # requests that may wait for a running place ([serving] max_queue)
    per_key: int | None   # places (running + waiting) one API key may hold; None: no limit
    queue_timeout: float  # seconds a request may wait in the queue before a 503


class Ticket:
    """A running place in a gate, held until `release()` (safe to call more than once)."""

    __slots__ = ("_gate", "key", "released")

    def __init__(self, gate: AdmissionGate, key: str | None) -> None:
        self._gate = gate
        self.key = key
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate._release(self)


class AdmissionGate:
    """One deployment's gate: `running` requests hold places, `queued` wait in FIFO order for one.

    `limits` is called for each decision; `on_wait` when a request starts waiting while nothing runs (so the control
    plane starts or wakes a replica); `changed` returns an event that is set when the deployment next changes (a
    replica became ready or died), after which waiting requests are let in if the capacity grew.
    """

    def __init__(self, name: str, limits: Callable[[], Limits], *, on_wait: Callable[[], None] | None = None,
                 changed: Callable[[], asyncio.Event] | None = None,
                 on_queue_change: Callable[[int], None] | None = None) -> None:
        self.name = name
        self._limits = limits
        self._on_wait = on_wait
        self._changed = changed
        self._on_queue_change = on_queue_change
        self.running = 0
        self._queue: deque[tuple[Ticket, asyncio.Future[None]]] = deque()
        self._per_key: Counter[str] = Counter()
        self._watcher: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def held_by(self, key: str) -> int:
        return self._per_key[key]

    async def admit(self, key: str | None = None) -> Ticket:
        """A running place for a request of API key `key` (None: no key, as with `--no-auth`).

        Raises QueueFull (429) at once when the key holds its limit or the queue is full, NoReplicaAvailable (503)
        after waiting the queue timeout. Cancelled (the client left), it leaves the queue and holds nothing.
        """
        limits = self._limits()
        if key is not None and limits.per_key is not None and self._per_key[key] >= limits.per_key:
            raise QueueFull(f"'{self.name}': this API key already has {self._per_key[key]} requests running or "
                            f"waiting, its limit on this model (max_concurrency_per_key = {limits.per_key}); "
                            "retry when one finishes", retry_after=FULL_RETRY_AFTER_S)
        ticket = Ticket(self, key)
        if not self._queue and self.running < limits.running:
            self._grant(ticket)
            return ticket
        if len(self._queue) >= limits.queue:
            raise QueueFull(f"'{self.name}' is overloaded: {self.running} requests running (capacity "
                            f"{limits.running}) and {len(self._queue)} waiting (max_queue = {limits.queue}); "
                            "retry shortly", retry_after=FULL_RETRY_AFTER_S)
        if self._on_wait is not None and limits.running == 0:
            self._on_wait()  # may refuse at once: NoReplicaAvailable while the replicas' restarts back off
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (ticket, future)
        self._queue.append(entry)
        if key is not None:
            self._per_key[key] += 1
        self._queue_changed()
        self._watch()
        try:
            await asyncio.wait_for(asyncio.shield(future), limits.queue_timeout)
        except BaseException as e:
            if future.done() and not future.cancelled() and future.exception() is None:
                ticket.release()  # let in just as it gave up: hand the place on
            else:
                future.cancel()
                self._leave(entry)
            if isinstance(e, TimeoutError):
                raise NoReplicaAvailable(f"'{self.name}': the request waited {limits.queue_timeout:.0f} s in the "
                                         f"queue (its queue timeout) without a replica free to take it; retry "
                                         "shortly", retry_after=TIMEOUT_RETRY_AFTER_S) from None
            raise
        return ticket

    # --- internals ------------------------------------------------------------------------------------------

    def _grant(self, ticket: Ticket) -> None:
        self.running += 1
        if ticket.key is not None:
            self._per_key[ticket.key] += 1

    def _release(self, ticket: Ticket) -> None:
        self.running -= 1
        self._drop_key(ticket.key)
        self.pump()

    def _leave(self, entry: tuple[Ticket, asyncio.Future[None]]) -> None:
        with contextlib.suppress(ValueError):
            self._queue.remove(entry)
            self._drop_key(entry[0].key)
            self._queue_changed()

    def _drop_key(self, key: str | None) -> None:
        if key is not None:
            self._per_key[key] -= 1
            if self._per_key[key] <= 0:
                del self._per_key[key]

    def pump(self) -> None:
        """Let waiting requests in, oldest first, while there is running capacity."""
        if not self._queue:
            return
        limit = self._limits().running
        moved = False
        while self._queue and self.running < limit:
            ticket, future = self._queue.popleft()
            if future.done():  # it gave up already (its `_leave` will not find it now)
                self._drop_key(ticket.key)
                continue
            self.running += 1  # its key already counts it (it did while it waited)
            future.set_result(None)
            moved = True
        if moved:
            self._queue_changed()

    def _queue_changed(self) -> None:
        if self._on_queue_change is not None:
            self._on_queue_change(len(self._queue))

    def _watch(self) -> None:
        """While requests wait, follow the deployment: a replica that becomes ready lets them in."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._follow(), name=f"ember-admission-{self.name}")

    async def _follow(self) -> None:
        while self._queue:
            changed = self._changed() if self._changed is not None else asyncio.Event()
            self.pump()
            if not self._queue:
                return
            self._refuse_if_unavailable()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), WATCH_INTERVAL_S)

    def _refuse_if_unavailable(self) -> None:
        """Nothing runs and `on_wait` refuses (the replicas' restarts back off): the waiting requests get its 503 now
        rather than at their queue timeout."""
        if self._on_wait is None or self._limits().running > 0:
            return
        try:
            self._on_wait()
        except NoReplicaAvailable as e:
            for _, future in self._queue:
                if not future.done():
                    future.set_exception(NoReplicaAvailable(e.message, retry_after=e.retry_after))

    async def aclose(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher


class Admission:
    """The gates of every deployment, their limits read from its manifest's `[serving]` and `[runtime]` and from its
    ready replicas (this gateway's, plus `remote(dep)` more that other gateways run, from shared routing tables)."""

    def __init__(self, plane: ControlPlane, *, remote: Callable[[Deployment], int] | None = None) -> None:
        self.plane = plane
        self._remote = remote or (lambda dep: 0)
        self._gates: dict[str, AdmissionGate] = {}
        self._deployments: dict[str, Deployment] = {}

    def gate(self, dep: Deployment) -> AdmissionGate:
        """`dep`'s gate; a deployment deleted and deployed again under its name gets a new one."""
        gate = self._gates.get(dep.name)
        if gate is None or self._deployments[dep.name] is not dep:
            gate = AdmissionGate(dep.name, lambda: limits_of(dep, self._remote(dep)),
                                 on_wait=lambda: self.plane.ensure_replica(dep), changed=dep.changed_event,
                                 on_queue_change=lambda n: setattr(dep, "queued", n))
            self._gates[dep.name], self._deployments[dep.name] = gate, dep
        return gate

    async def aclose(self) -> None:
        await asyncio.gather(*(gate.aclose() for gate in self._gates.values()))


def limits_of(dep: Deployment, remote_replicas: int = 0) -> Limits:
    """What `dep` admits now. Running capacity per replica is the engine's `max_num_seqs` (a deploy's override of it
    included): beyond that an engine would only queue the request itself, unbounded."""
    manifest = dep.active.manifest
    serving = manifest.serving
    try:
        per_replica = int(dep.overrides.get("max_num_seqs", manifest.runtime.max_num_seqs))
    except ValueError:  # the replica refuses such an override at start; count the manifest's value meanwhile
        per_replica = manifest.runtime.max_num_seqs
    running = per_replica * (len(dep.ready_replicas()) + remote_replicas)
    per_key = serving.max_concurrency_per_key
    if per_key is None:  # by default one key may hold half of what the model admits: never all of it
        per_key = max(1, (running + serving.max_queue) // 2)
    timeout = serving.queue_timeout if serving.queue_timeout is not None else serving.request_timeout
    return Limits(running, serving.max_queue, per_key, timeout)
