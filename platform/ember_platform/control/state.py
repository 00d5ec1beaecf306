"""The deployment state (cold, starting, warm, sleeping) that the control plane writes to the routing tables.

The tables hold one state per model, shared by every gateway that points at them (in-process: this gateway's own
tables; with `--redis-url`: every gateway's). Which control plane writes it:

- A control plane that runs replicas of the model (an *owner*) writes the state of its replicas each time it
  changes: a deploy that starts replicas -> starting, the first ready one -> warm, all of them asleep -> sleeping,
  none left (scaled to zero, deleted, `ember serve` stopped) -> cold. Where other gateways' replicas of the model
  are ready in the shared tables, the model is warm whatever this plane's own replicas do, and it says so.
- A control plane that runs none (a gateway that routes to other gateways' replicas, as gateway B of
  bench_routing.py) writes nothing: readers derive the state from the replicas in the tables
  (`RoutingTables.deployment_state`), which is all such a plane could say, and it would only overwrite an owner's
  sleeping or starting with a guess.
- A Redis restart loses the stored states: every owner writes its own again at the next check.

Writes happen off the event loop (a Redis round trip), coalesced: each change marks the deployment, and one task
writes what changed, plus a check of every deployment each `interval` (changes in other gateways' replicas and a
lost store send no event here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from ember_platform.control.deployments import Deployment, ReplicaState
from ember_platform.routing import DeploymentState, RoutingError, RoutingTables
from ember_platform.routing import ReplicaState as RoutedState

logger = logging.getLogger("ember.control.state")


def local_state(dep: Deployment) -> DeploymentState:
    """The state of the replicas this control plane runs for `dep` (those it is stopping do not count)."""
    if dep.deleted:
        return DeploymentState.COLD
    states = {r.state for r in dep.replicas if not r.stopping}
    if ReplicaState.READY in states:
        return DeploymentState.WARM
    if ReplicaState.STARTING in states:
        return DeploymentState.STARTING
    if ReplicaState.SLEEPING in states:
        return DeploymentState.SLEEPING
    return DeploymentState.COLD


class DeploymentStates:
    """Writes each deployment's state to the routing tables when it changes (see the module's docstring)."""

    def __init__(self, tables: RoutingTables, *, interval: float = 1.0) -> None:
        self.tables = tables
        self.interval = interval
        self._written: dict[str, DeploymentState] = {}  # model -> what this plane last wrote
        self._own_ids: dict[str, set[str]] = {}          # model -> replicas this plane launched (owner when any)
        self._dirty: dict[str, Deployment] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    # --- what the control plane tells it -----------------------------------------------------------------

    def launched(self, dep: Deployment, replica_id: str) -> None:
        self._own_ids.setdefault(dep.name, set()).add(replica_id)
        self.changed(dep)

    def changed(self, dep: Deployment) -> None:
        """Something about `dep`'s replicas changed: write its state if that changed it (soon, off the loop)."""
        self._dirty[dep.name] = dep
        if self._wake is not None:
            self._wake.set()

    def start(self, deployments: Callable[[], Iterable[Deployment]]) -> None:
        """Write changes from now on, and check `deployments()` every interval."""
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(deployments), name="ember-deployment-states")

    async def close(self, deployments: Iterable[Deployment] = ()) -> None:
        """Stop the task, then write the final state of `deployments` (their replicas stopped: cold, unless other
        gateways' replicas serve the model)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for dep in deployments:
            try:
                await self._publish(dep, recheck=False)
            except Exception:  # shutting down goes on regardless
                logger.exception("%s: writing the final deployment state failed", dep.name)

    # --- reading ------------------------------------------------------------------------------------------

    async def read(self, dep: Deployment) -> tuple[DeploymentState, str]:
        """The model's state and where it came from: the routing tables (stored, or derived from the replicas in
        them), or this control plane's own replicas when the tables cannot be reached."""
        try:
            return await asyncio.to_thread(self.tables.deployment_state, dep.name), "routing tables"
        except RoutingError as e:
            logger.debug("%s: deployment state from the routing tables failed: %s", dep.name, e)
            return local_state(dep), "this gateway's replicas (the routing tables cannot be reached)"

    # --- internals ----------------------------------------------------------------------------------------

    async def _run(self, deployments: Callable[[], Iterable[Deployment]]) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        next_check = loop.time() + self.interval
        while True:
            # asyncio.wait, not wait_for: Python 3.11's wait_for swallows a cancellation that arrives as the event is
            # set (as when shutdown stops the replicas, then this task), and this loop would never end.
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({woken}, timeout=max(0.0, next_check - loop.time()))
            finally:
                woken.cancel()
            self._wake.clear()
            due, self._dirty = self._dirty, {}
            recheck = loop.time() >= next_check
            if recheck:
                next_check = loop.time() + self.interval
                for dep in deployments():
                    due.setdefault(dep.name, dep)
            for dep in due.values():
                try:
                    await self._publish(dep, recheck=recheck)
                except Exception:  # a bug here must not stop the states of every other deployment
                    logger.exception("%s: writing the deployment state failed", dep.name)

    async def _publish(self, dep: Deployment, *, recheck: bool) -> None:
        own = self._own_ids.get(dep.name)
        if not own:
            return  # runs no replica of it: readers derive the state from the replicas in the tables
        state = local_state(dep)
        live = {r.id for r in dep.replicas}
        try:
            gone = await asyncio.to_thread(self._write, dep.name, state, frozenset(own), live, recheck)
        except RoutingError as e:
            if not self._failing:  # once per outage; the next check writes it (nothing marked it written)
                logger.warning("%s: cannot write the deployment state (%s) to the routing tables: %s", dep.name,
                               state, e)
            self._failing = True
            return
        own -= gone  # (the same set that `launched` adds to: both run on the event loop)
        if self._failing:
            logger.info("routing tables reachable again: deployment states written")
        self._failing = False

    def _write(self, model: str, state: DeploymentState, own: frozenset[str], live: set[str],
               recheck: bool) -> set[str]:
        """In a worker thread: the tables' round trips. `own`: the replicas this plane launched, `live` those it
        still runs (a killed one stays in the tables until its lease lapses, and must not pass for another
        gateway's). Returns the departed ones that the tables no longer hold either, to forget."""
        gone: set[str] = set()
        departed = own - live
        if state is not DeploymentState.WARM or (recheck and departed):
            views = self.tables.snapshot(model)
            listed = {v.replica_id for v in views}
            gone = set(departed - listed)
            if state is not DeploymentState.WARM and any(
                    v.record.state == RoutedState.READY and v.replica_id not in own
                    for v in views):
                state = DeploymentState.WARM  # another gateway's replicas serve it
        previous = self._written.get(model)
        if previous == state and not (recheck and self.tables.stored_deployment_state(model) is None):
            return gone
        self.tables.set_deployment_state(model, state)
        self._written[model] = state
        if previous == state:
            logger.info("%s: deployment state %s written again (the tables had lost it)", model, state)
        else:
            logger.info("%s: deployment state %s -> %s", model, previous or "unset", state)
        return gone
