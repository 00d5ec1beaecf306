"""The launcher contract: what the control plane asks of whatever runs its replicas (local processes, Ray, a cluster).

A launcher plugin registers a factory with `ember_launchers(register)`; the control plane builds the one chosen
(`ember serve --launcher NAME`, "local" by default) with `LaunchSettings`, then for every replica calls
`start(ReplicaSpec) -> handle`, follows `status(handle)` until it is running at a URL (or exited), and ends it with
`stop(handle, grace_s)`. The handle is the launcher's own object: the control plane only passes it back.

It lives in `ember`, not in the platform, because a launcher needs nothing of the engine: one for a cluster
scheduler is written and tested without torch, and runs where the control plane runs.

What a replica is given is a registry reference and the package digest, never a path on the control plane's
machine: the replica side (`python -m ember_platform.replica --registry URL --reference NAME:VERSION --digest D`)
pulls the package through its own blob cache and refuses a registry whose NAME:VERSION has another digest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from ember.errors import EmberError

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
READY_LINE = "EMBER_REPLICA_READY"  # a replica process prints it with its URL on stdout once it is ready
SECRET_ENV = "EMBER_REPLICA_SECRET"  # how a process launcher hands the replica its secret (never argv: `ps` shows it)
REPLICA_ID_ENV = "EMBER_REPLICA_ID"


class LaunchError(EmberError):
    """A replica could not be started, or was refused (a spec the launcher cannot honour); the message says why."""


@dataclass(frozen=True, slots=True)
class Resources:
    """What one replica needs. `gpus`: accelerators it must own (its parallel world size; 0 on CPU)."""

    gpus: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"Resources.gpus must be >= 0, got {self.gpus}")


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica to start: which package (by registry reference and digest), with what, in which role.

    `secret` is what every request to the replica but its probes must carry; a launcher hands it over through a
    channel other users cannot read (a process's environment, a cluster secret), never a command line or a log.
    """

    deployment: str                   # the model name requests use
    version: str
    digest: str                       # "sha256:...": the replica refuses a package with any other
    registry_url: str                 # a directory path or s3://bucket/prefix (ember.registry.open_registry)
    replica_id: str                   # the control plane's id for it (shared routing tables key replicas by it)
    secret: str = field(repr=False)
    registry_endpoint_url: str | None = None  # an S3 endpoint other than AWS's
    overrides: Mapping[str, str] = field(default_factory=dict)  # engine overrides, as `--override KEY=VALUE`
    resources: Resources = field(default_factory=Resources)
    role: Role = "both"               # disaggregated serving runs "prefill" and "decode" replicas
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for the replica

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"ReplicaSpec.role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.digest.startswith("sha256:"):
            raise ValueError(f"ReplicaSpec.digest must be 'sha256:...', got {self.digest!r}")

    @property
    def reference(self) -> str:
        """NAME:VERSION in the registry."""
        return f"{self.deployment}:{self.version}"

    @property
    def label(self) -> str:
        """A name for logs and process titles: deployment, version and replica id."""
        return f"{self.deployment}-{self.version}-{self.replica_id}"


class LaunchState(StrEnum):
    STARTING = "starting"  # placed and loading (pulling, weights, warm-up)
    RUNNING = "running"    # ready to serve at `url`
    EXITED = "exited"      # gone: it stopped, crashed, or never came up (`exit_code`, `reason`)


@dataclass(frozen=True, slots=True)
class LaunchStatus:
    """Where a started replica is now. Build one with `starting()`, `running(url)` or `exited(code, reason)`."""

    state: LaunchState
    url: str | None = None
    exit_code: int | None = None
    reason: str | None = None

    @classmethod
    def starting(cls) -> LaunchStatus:
        return cls(LaunchState.STARTING)

    @classmethod
    def running(cls, url: str) -> LaunchStatus:
        return cls(LaunchState.RUNNING, url=url.rstrip("/"))

    @classmethod
    def exited(cls, exit_code: int | None, reason: str) -> LaunchStatus:
        return cls(LaunchState.EXITED, exit_code=exit_code, reason=reason)


class Launcher(ABC):
    """Runs replicas somewhere. Every method is called on the control plane's event loop: none may block it."""

    @abstractmethod
    async def start(self, spec: ReplicaSpec) -> Any:
        """Start one replica and return a handle at once (loading goes on; follow it with `status`). Raise
        LaunchError for a spec this launcher cannot honour (say what and why: "not supported yet: ...")."""

    @abstractmethod
    async def status(self, handle: Any) -> LaunchStatus:
        """Where the replica is: starting, running at a URL, or exited (with its code and why). Called often
        (every probe interval for every replica): answer from what is known, without a long round trip."""

    @abstractmethod
    async def stop(self, handle: Any, grace_s: float) -> None:
        """Stop the replica: let it drain for up to `grace_s` seconds (requests in flight finish), then kill it;
        `grace_s=0` kills it at once. Returns once it is gone. Stopping one that exited already does nothing."""

    def describe(self, handle: Any) -> Mapping[str, Any]:
        """What an operator may want to know about one replica (`/admin/deployments/NAME`): e.g. pid, log, node."""
        return {}

    async def aclose(self) -> None:  # noqa: B027 (optional: most launchers hold nothing)
        """The control plane is done with this launcher (every replica stopped): release what it holds."""


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """What a launcher factory is built with: `ember serve`'s settings that concern where replicas run.

    `home`: a directory the launcher may keep state in (logs, pulled packages). `options`: launcher-specific
    settings (`ember serve --launcher-option KEY=VALUE`); a factory refuses a key it does not know.
    `launcher(name)` builds another installed launcher with these settings, for launchers that wrap one.
    """

    home: Path
    host: str = "127.0.0.1"
    redis_url: str | None = None
    drain_timeout_s: float = 30.0
    options: Mapping[str, str] = field(default_factory=dict)
    launcher: Callable[[str], Launcher] | None = field(default=None, repr=False, compare=False)


LauncherFactory = Callable[[LaunchSettings], Launcher]
