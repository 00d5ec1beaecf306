"""What the control plane refuses: each error carries the HTTP status the gateway answers, and maybe a Retry-After."""

from __future__ import annotations

from collections.abc import Collection


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
