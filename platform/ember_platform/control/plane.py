"""`ControlPlane`: deploys registry packages as replicas, switches versions without dropping requests, supervises.

Everything runs on the gateway's event loop. Operations on one deployment (deploy, promote, rollback, delete) take
its lock, so they happen one at a time; requests never take it: they only wait for a ready replica. The parts, each
in its own module: deploy operations (operations.py), the request path (admission.py), autoscaling
(autoscaling.py), supervision of the replicas the launcher runs (supervision.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx

from ember.launch import Launcher
from ember.registry import BlobCache, Registry
from ember_platform.control.admission import RequestAdmission
from ember_platform.control.autoscaler import ScaleMemory
from ember_platform.control.autoscaling import Autoscaling
from ember_platform.control.backoff import BackoffPolicy
from ember_platform.control.deployments import Deployment, Replica
from ember_platform.control.errors import (
    Conflict,
    ControlError,
    DeployError,
    DeploymentNotFound,
    InvalidDeployment,
    NoReplicaAvailable,
    QueueFull,
    VersionNotFound,
)
from ember_platform.control.operations import DeployOperations
from ember_platform.control.state import DeploymentStates
from ember_platform.control.supervision import Supervision
from ember_platform.routing import DeploymentState, RoutingTables
from ember_platform.routing.memory import InProcessTables

__all__ = ["Conflict", "ControlError", "ControlPlane", "DeployError", "DeploymentNotFound", "InvalidDeployment",
           "NoReplicaAvailable", "QueueFull", "VersionNotFound"]

PROBE_TIMEOUT_S = 2.0


class ControlPlane(DeployOperations, RequestAdmission, Autoscaling, Supervision):
    """Deployments by name. Call `start()` on the running loop before use, and `shutdown()` at the end."""

    def __init__(self, registry: Registry, *, packages_dir: Path, launcher: Launcher, cache: BlobCache | None = None,
                 probe_interval: float = 1.0, restart_backoff: BackoffPolicy | None = None,
                 wait_timeout: float = 120.0, start_timeout: float = 900.0, replica_secret: str | None = None,
                 routing_tables: RoutingTables | None = None) -> None:
        """`launcher`: what runs the replicas (ember.launch; `ember serve --launcher`). `routing_tables`: where
        each deployment's state (cold, starting, warm, sleeping) is written, the tables the gateway routes with
        (shared with other gateways through Redis); in-process tables of its own otherwise. `restart_backoff`: how
        long replacements of replicas that keep failing wait (control/backoff.py). `start_timeout`: the longest a
        replica may report "starting" before it is stopped as failed (a launcher's own limit may be shorter).
        `replica_secret`: the cluster secret every replica requires (gateways sharing routing tables route to each
        other's replicas: replica/auth.py); None gives each replica a fresh one, which only this plane knows.
        """
        self.registry = registry
        self.packages_dir = Path(packages_dir)
        self.launcher = launcher
        self.cache = cache or BlobCache.default()
        self.probe_interval = probe_interval
        self.restart_backoff = restart_backoff or BackoffPolicy()
        self.wait_timeout = wait_timeout  # longest a request waits for a ready replica (e.g. a cold start)
        self.start_timeout = start_timeout
        self.replica_secret = replica_secret
        self._deployments: dict[str, Deployment] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._launching: dict[str, asyncio.Task[Replica]] = {}
        self._retiring: dict[str, asyncio.Task[None]] = {}
        self._restart_timers: dict[str, asyncio.TimerHandle] = {}
        self._scale_memory: dict[str, ScaleMemory] = {}
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
        await self.launcher.aclose()
        if self._probe_client is not None:
            await self._probe_client.aclose()

    # --- queries ------------------------------------------------------------------------------------------

    def list(self) -> list[Deployment]:
        return [self._deployments[name] for name in sorted(self._deployments)]

    def names(self) -> list[str]:
        return sorted(self._deployments)

    async def deployment_state(self, dep: Deployment) -> tuple[DeploymentState, str]:
        """The deployment's state (cold, starting, warm, sleeping) as the routing tables hold it (with Redis, as
        every gateway sees it), and where that came from."""
        return await self.states.read(dep)
