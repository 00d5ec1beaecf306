"""Launchers start and stop replicas: `LocalProcessLauncher` runs each as a child process on this machine.

The control plane only sees the `Launcher` interface, so a cluster scheduler can take the local launcher's place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember_platform.replica.auth import SECRET_ENV, new_secret

logger = logging.getLogger("ember.control.launcher")

READY_LINE = "EMBER_REPLICA_READY "
LOG_TAIL_LINES = 20


class LaunchError(Exception):
    """A replica did not come up: its process exited, or it was not ready in time. The message ends with its log."""


@dataclass(eq=False)
class ReplicaHandle:
    """What a launcher gives back for a started replica: where it listens, and how to find it again."""

    url: str
    pid: int | None = None
    log_path: Path | None = None
    secret: str | None = field(default=None, repr=False)  # what the replica requires on every call but its probes
    process: Any = field(default=None, repr=False)  # the launcher's own object (here an asyncio Process)


class Launcher(ABC):
    """Starts replicas of a package directory and stops them again."""

    @abstractmethod
    async def start(self, package_dir: Path, overrides: Mapping[str, str], *, label: str = "replica",
                    replica_id: str | None = None) -> ReplicaHandle:
        """Start a replica and return once it is ready (its weights loaded and warmed up); raise LaunchError.

        `replica_id` is the control plane's id for it: a replica that publishes to shared routing tables uses it.
        """

    @abstractmethod
    async def stop(self, handle: ReplicaHandle, graceful: bool = True) -> None:
        """Stop a replica: gracefully lets it drain (in-flight requests finish), otherwise kills it at once."""

    @abstractmethod
    def alive(self, handle: ReplicaHandle) -> bool:
        """Whether the replica's process is still running."""


def default_replica_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """torch CPU threads for a replica on this machine, or None to let OMP_NUM_THREADS (when set) decide.

    torch's own default is one thread per core. A replica shares its machine with its own HTTP event loop, the
    gateway and often clients; with a thread on every core, each of its small CPU ops waits for a core someone
    else holds. So one core is left to the rest: cores - 1, at least 1.
    """
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use (a container's CPU set)
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGTERM the child when this process dies, so no replica outlives a killed
    `ember serve`. Resolved here, in the parent, so the child only makes one libc call between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)

    return preexec


class LocalProcessLauncher(Launcher):
    """Each replica is `python -m ember_platform.replica --package DIR --port P` in its own session (so Ctrl-C at the
    terminal reaches only `ember serve`, which drains the replicas itself). Output goes to one log file per replica.
    """

    def __init__(self, *, log_dir: Path, host: str = "127.0.0.1", python: str = sys.executable,
                 start_timeout: float = 300.0, drain_timeout: float = 30.0, kill_timeout: float = 10.0,
                 threads: int | None = None, redis_url: str | None = None, secret: str | None = None) -> None:
        """`secret`: the cluster secret every replica gets (replica/auth.py), for gateways that route to each other's
        replicas; None gives each replica a fresh one of its own, which only this launcher's caller knows."""
        self.log_dir = Path(log_dir)
        self.secret = secret
        self.redis_url = redis_url  # replicas publish their load and KV blocks there for every gateway
        # torch CPU threads per replica: given, or the machine's default (`default_replica_threads`).
        self.threads = threads if threads is not None else default_replica_threads()
        self.host = host
        self.python = python
        self.start_timeout = start_timeout
        self.drain_timeout = drain_timeout
        self.kill_timeout = kill_timeout
        self._pumps: set[asyncio.Task[None]] = set()

    def command(self, package_dir: Path, overrides: Mapping[str, str]) -> list[str]:
        # Port 0: the replica binds a free port itself and reports it on its ready line (no race for the port).
        cmd = [self.python, "-m", "ember_platform.replica", "--package", str(package_dir), "--host", self.host,
               "--port", "0", "--drain-timeout", str(self.drain_timeout)]
        if self.threads is not None:
            cmd += ["--threads", str(self.threads)]
        if self.redis_url:
            cmd += ["--redis-url", self.redis_url]
        for key, value in overrides.items():
            cmd += ["--override", f"{key}={value}"]
        return cmd

    async def start(self, package_dir: Path, overrides: Mapping[str, str], *, label: str = "replica",
                    replica_id: str | None = None) -> ReplicaHandle:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{label}.log"
        cmd = self.command(package_dir, overrides)
        # The secret goes through the environment, never argv (which any local user sees in `ps`).
        secret = self.secret or new_secret()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", SECRET_ENV: secret,
               **({"EMBER_REPLICA_ID": replica_id} if replica_id else {})}
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            process = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=log, env=env,
                start_new_session=True, preexec_fn=die_with_parent())
        handle = ReplicaHandle(url="", pid=process.pid, log_path=log_path, process=process, secret=secret)
        try:
            handle.url = await asyncio.wait_for(self._read_ready(process, log_path), self.start_timeout)
        except TimeoutError:
            await self.stop(handle, graceful=False)
            raise LaunchError(f"replica of {package_dir} was not ready within {self.start_timeout:.0f} s"
                              f"{self._tail(log_path)}") from None
        except BaseException:
            await self.stop(handle, graceful=False)
            raise
        # Keep reading stdout into the log: a full pipe would block the replica.
        pump = asyncio.create_task(self._pump(process, log_path))
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)
        logger.info("replica %s ready at %s (pid %s, log %s)", label, handle.url, process.pid, log_path)
        return handle

    async def _read_ready(self, process: asyncio.subprocess.Process, log_path: Path) -> str:
        assert process.stdout is not None
        while True:
            raw = await process.stdout.readline()
            if not raw:
                code = await process.wait()
                raise LaunchError(f"replica exited with code {code} before it was ready{self._tail(log_path)}")
            line = raw.decode(errors="replace")
            with open(log_path, "a") as log:
                log.write(line)
            if line.startswith(READY_LINE):
                return line.removeprefix(READY_LINE).strip().rstrip("/")

    @staticmethod
    async def _pump(process: asyncio.subprocess.Process, log_path: Path) -> None:
        assert process.stdout is not None
        with open(log_path, "ab") as log:
            while raw := await process.stdout.readline():
                log.write(raw)
                log.flush()

    @staticmethod
    def _tail(log_path: Path) -> str:
        try:
            lines = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            return ""
        return f"; last lines of {log_path}:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""

    async def stop(self, handle: ReplicaHandle, graceful: bool = True) -> None:
        process: asyncio.subprocess.Process = handle.process
        if process.returncode is not None:
            return
        deadline = time.monotonic() + (self.drain_timeout + self.kill_timeout if graceful else 0)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            await asyncio.wait_for(process.wait(), max(deadline - time.monotonic(), self.kill_timeout))
        except TimeoutError:
            logger.warning("replica pid %s did not exit after SIGTERM; killing it", process.pid)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), self.kill_timeout)

    def alive(self, handle: ReplicaHandle) -> bool:
        process: asyncio.subprocess.Process = handle.process
        return process.returncode is None
