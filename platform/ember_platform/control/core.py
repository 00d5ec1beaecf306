"""The state the control plane's parts share (deploy operations, admission, autoscaling, supervision) and the
methods they call on one another. `ControlPlane` (plane.py) puts the parts together."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from ember.launch import Launcher
from ember.registry import BlobCache, Registry
from ember_platform.control.autoscaler import ScaleMemory
from ember_platform.control.backoff import BackoffPolicy
from ember_platform.control.deployments import Deployment, Replica
from ember_platform.control.errors import DeploymentNotFound
from ember_platform.control.state import DeploymentStates

if TYPE_CHECKING:
    from ember_platform.control.errors import NoReplicaAvailable

logger = logging.getLogger("ember.control")


class PlaneCore:
    """Attributes set by `ControlPlane.__init__`; the methods each part provides to the others are declared here."""

    registry: Registry
    packages_dir: Path
    launcher: Launcher
    cache: BlobCache
    probe_interval: float
    restart_backoff: BackoffPolicy
    wait_timeout: float
    start_timeout: float
    replica_secret: str | None  # the cluster secret every replica gets; None: a fresh one each
    states: DeploymentStates
    _deployments: dict[str, Deployment]
    _locks: dict[str, asyncio.Lock]
    _launching: dict[str, asyncio.Task[Replica]]     # replica id -> its start
    _retiring: dict[str, asyncio.Task[None]]         # replica id -> its drain and stop
    _restart_timers: dict[str, asyncio.TimerHandle]  # deployment -> its reconcile when the backoff ends
    _scale_memory: dict[str, ScaleMemory]            # deployment -> the autoscaler's memory
    _probe_client: httpx.AsyncClient | None
    _closing: bool

    def get(self, name: str) -> Deployment:
        try:
            return self._deployments[name]
        except KeyError:
            raise DeploymentNotFound(name, self._deployments) from None

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    if TYPE_CHECKING:  # provided by the parts (supervision.py, autoscaling.py, admission.py)
        def _reconcile(self, dep: Deployment) -> list[asyncio.Task[Replica]]: ...
        def _launch(self, dep: Deployment, version: str) -> asyncio.Task[Replica]: ...
        def _retire(self, dep: Deployment, replica: Replica, *, grace: float | None = None) -> asyncio.Task[None]: ...
        def _bury(self, dep: Deployment, replica: Replica, code: int | None = None) -> None: ...
        def _autoscale(self, dep: Deployment) -> None: ...
        def _sleep(self, dep: Deployment, replica: Replica) -> None: ...
        def _wake(self, dep: Deployment, sleepers: list[Replica]) -> list[Replica]: ...
        def _backing_off(self, dep: Deployment) -> NoReplicaAvailable | None: ...
        def _unavailable(self, dep: Deployment, waited: float) -> NoReplicaAvailable: ...


def retrieve(task: asyncio.Task[object]) -> None:
    """Mark a background task's exception as seen (it was logged or raised to an awaiting caller)."""
    if not task.cancelled():
        task.exception()
