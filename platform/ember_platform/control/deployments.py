"""Deployments and their state: versions pulled from a registry, the active one, and the replicas serving it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember_platform.control.backoff import RestartBackoff

if TYPE_CHECKING:
    from ember.manifest import Manifest

MAX_EVENTS = 50


class ReplicaState(StrEnum):
    STARTING = "starting"  # process launched, weights loading
    READY = "ready"        # takes requests
    SLEEPING = "sleeping"  # idle: its engine freed the KV cache and keeps the weights; a request wakes it
    DRAINING = "draining"  # finishes what it has, takes nothing new (stopped by us, or SIGTERMed from outside)
    DEAD = "dead"          # its process exited


@dataclass(eq=False, slots=True)
class Replica:
    """One replica of one version of a deployment (run by the launcher, or found in shared routing tables)."""

    version: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    state: ReplicaState = ReplicaState.STARTING
    handle: Any = None              # the launcher's handle for it (ember.launch): opaque, passed back to it
    local_url: str | None = None    # where it serves, once the launcher reports it running
    local_secret: str | None = field(default=None, repr=False)  # what its ReplicaSpec told it to require
    launch_info: dict[str, Any] = field(default_factory=dict)   # the launcher's `describe` (pid, log, node)
    created_at: float = field(default_factory=time.time)
    start_s: float | None = None  # launch -> ready, as the control plane saw it
    ready_at: float | None = None  # monotonic time it became ready (the crash-loop backoff forgives after a while)
    stopping: bool = False        # the control plane is draining it (it will not come back)
    in_flight: int = 0            # requests the gateway has open on it
    served: int = 0
    remote_url: str | None = None  # a replica another gateway's control plane runs, found in the routing tables
    remote_secret: str | None = field(default=None, repr=False)  # the cluster secret such a replica requires

    @property
    def url(self) -> str | None:
        return self.local_url or self.remote_url

    @property
    def secret(self) -> str | None:
        """What the replica requires in `Authorization: Bearer ...` (replica/auth.py)."""
        return self.local_secret or self.remote_secret

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "version": self.version, "state": str(self.state), "url": self.url,
                "pid": self.launch_info.get("pid"), "launcher": self.launch_info, "in_flight": self.in_flight,
                "served": self.served, "start_s": self.start_s, "created_at": self.created_at}


@dataclass(frozen=True, slots=True)
class PullRecord:
    """How a version reached the local packages directory: the 'pull' phase of a cold start."""

    resolve_s: float
    pull_s: float
    downloaded_bytes: int
    blobs_downloaded: int
    blobs_from_cache: int
    reused: bool  # the directory was there already, with the same digest: nothing was pulled

    def to_json(self) -> dict[str, Any]:
        return {"resolve_s": self.resolve_s, "pull_s": self.pull_s, "downloaded_bytes": self.downloaded_bytes,
                "blobs_downloaded": self.blobs_downloaded, "blobs_from_cache": self.blobs_from_cache,
                "reused": self.reused}


@dataclass(slots=True)
class DeploymentVersion:
    version: str
    digest: str
    package_dir: Path
    manifest: Manifest
    pull: PullRecord
    deployed_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "digest": self.digest, "package_dir": str(self.package_dir),
                "deployed_at": self.deployed_at, "pull": self.pull.to_json()}


@dataclass(frozen=True, slots=True)
class Scaling:
    """The replica counts that apply to one version: its manifest's [scaling], then the deploy's overrides."""

    min_replicas: int
    max_replicas: int
    prewarm: bool
    target_concurrency: int = 32
    scale_down_delay: float = 900.0

    @property
    def initial(self) -> int:
        """Replicas started at deploy time: at least one when prewarmed, none for a scale-to-zero model."""
        wanted = max(1, self.min_replicas) if self.prewarm else self.min_replicas
        return min(wanted, self.max_replicas)


@dataclass(eq=False, slots=True)
class Deployment:
    """A model name served by the gateway; requests go to ready replicas of `active_version`."""

    name: str
    active_version: str
    versions: dict[str, DeploymentVersion] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)  # earlier active versions, most recent last (rollback)
    replicas: list[Replica] = field(default_factory=list)
    min_replicas: int | None = None  # overrides of [scaling], kept across versions
    max_replicas: int | None = None
    overrides: dict[str, str] = field(default_factory=dict)  # passed to every replica as --override KEY=VALUE
    desired: int = 0    # replicas of the active version the supervisor keeps alive
    waiting: int = 0    # requests waiting for a ready replica
    queued: int = 0     # requests waiting in the gateway's admission queue (gateway/admission.py) for a place
    backoff: RestartBackoff = field(default_factory=RestartBackoff)  # replica failures in a row, restarts
    last_error: str | None = None
    created_at: float = field(default_factory=time.time)
    events: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    sleeping_since: float | None = None  # monotonic time its replicas went to sleep (then to zero after the delay)
    deleted: bool = False
    on_change: Callable[[Deployment], None] | None = field(default=None, repr=False)  # called by notify()
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def changed_event(self) -> asyncio.Event:
        """Set at the next change of replicas or versions. Take it *before* checking what you wait for."""
        return self._changed

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        if self.on_change is not None:
            self.on_change(self)

    @property
    def active(self) -> DeploymentVersion:
        return self.versions[self.active_version]

    def scaling(self, version: str | None = None) -> Scaling:
        section = self.versions[version or self.active_version].manifest.scaling
        low = section.min_replicas if self.min_replicas is None else self.min_replicas
        high = section.max_replicas if self.max_replicas is None else self.max_replicas
        return Scaling(low, max(high, low), section.prewarm, section.target_concurrency, section.scale_down_delay)

    def demand(self) -> int:
        """Requests open on this deployment's replicas plus those waiting for one: what the autoscaler serves."""
        return self.waiting + self.queued + sum(r.in_flight for r in self.replicas if r.state is not ReplicaState.DEAD)

    @property
    def max_queue(self) -> int:
        return self.active.manifest.serving.max_queue

    @property
    def request_timeout(self) -> float:
        return self.active.manifest.serving.request_timeout

    def replicas_of(self, version: str, *states: ReplicaState) -> list[Replica]:
        return [r for r in self.replicas if r.version == version and (not states or r.state in states)]

    def ready_replicas(self) -> list[Replica]:
        """Replicas that take new requests: ready ones of the active version."""
        return self.replicas_of(self.active_version, ReplicaState.READY)

    def sleeping_replicas(self) -> list[Replica]:
        return self.replicas_of(self.active_version, ReplicaState.SLEEPING)

    def live_replicas(self) -> list[Replica]:
        """Active-version replicas that count towards `desired`: starting or ready, not on their way out."""
        return [r for r in self.replicas_of(self.active_version, ReplicaState.STARTING, ReplicaState.READY)
                if not r.stopping]

    def log(self, message: str) -> None:
        self.events.append(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}")

    def state_counts(self) -> dict[str, int]:
        counts = {str(state): 0 for state in ReplicaState}
        for replica in self.replicas:
            counts[str(replica.state)] += 1
        return counts

    def to_json(self, *, detail: bool = False) -> dict[str, Any]:
        active = self.active
        scaling = self.scaling()
        out: dict[str, Any] = {
            "name": self.name, "active_version": self.active_version, "digest": active.digest,
            "versions": sorted(self.versions), "history": list(self.history),
            "replicas": [r.to_json() for r in self.replicas], "desired_replicas": self.desired,
            "scaling": {"min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
                        "prewarm": scaling.prewarm, "target_concurrency": scaling.target_concurrency,
                        "scale_down_delay": scaling.scale_down_delay},
            "waiting": self.waiting + self.queued, "last_error": self.last_error, "created_at": self.created_at,
            "restarts": self.backoff.to_json(time.monotonic()),
        }
        if detail:
            out["version_details"] = {v: self.versions[v].to_json() for v in sorted(self.versions)}
            out["overrides"] = dict(self.overrides)
            out["events"] = list(self.events)
        return out
