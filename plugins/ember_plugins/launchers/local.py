"""The "local" launcher: each replica is `python -m ember_platform.replica` in a child process on this machine.

The replica gets the registry reference and digest from its ReplicaSpec and checks the package out itself, into a
packages directory and blob cache on this machine (shared with the control plane under `ember serve`, so a version
is pulled once). Each replica runs in its own session (Ctrl-C at the terminal reaches only `ember serve`, which
drains the replicas itself) and dies with its parent; its output goes to one log file per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.launch import (
    READY_LINE,
    REPLICA_ID_ENV,
    SECRET_ENV,
    Launcher,
    LaunchError,
    LaunchSettings,
    LaunchStatus,
    ReplicaSpec,
)
from ember.registry import BlobCache

logger = logging.getLogger("ember.launchers.local")

LOG_TAIL_LINES = 20
OPTIONS = ("threads", "gpus", "start_timeout", "packages_dir", "blob_cache")


@dataclass(eq=False)
class LocalReplica:
    """The local launcher's handle: one child process, and what its ready line said."""

    spec: ReplicaSpec
    process: asyncio.subprocess.Process
    log_path: Path
    gpus: tuple[int, ...] = ()
    url: str | None = None
    failure: str | None = None  # why it is not running, once it exited or was given up on
    reader: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid


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
    """Replicas as child processes. `gpus`: the device indices it may hand out (each replica gets
    `spec.resources.gpus` of its own through CUDA_VISIBLE_DEVICES); None hands out none and lets every replica see
    every device, as on a machine with one GPU or none."""

    def __init__(self, *, log_dir: Path, host: str = "127.0.0.1", python: str = sys.executable,
                 start_timeout: float = 300.0, drain_timeout: float = 30.0, kill_timeout: float = 10.0,
                 threads: int | None = None, redis_url: str | None = None, packages_dir: Path | None = None,
                 blob_cache: Path | None = None, gpus: Sequence[int] | None = None) -> None:
        """`packages_dir`, `blob_cache`: where replicas check their packages out (default: beside `log_dir`, as
        `ember serve`'s home lays them out, so a replica finds the version its control plane pulled)."""
        self.log_dir = Path(log_dir)
        self.packages_dir = Path(packages_dir) if packages_dir else self.log_dir.parent / "packages"
        self.blob_cache = Path(blob_cache) if blob_cache else self.log_dir.parent / "blob-cache"
        self.redis_url = redis_url  # replicas publish their load and KV blocks there for every gateway
        # torch CPU threads per replica: given, or the machine's default (`default_replica_threads`).
        self.threads = threads if threads is not None else default_replica_threads()
        self.host = host
        self.python = python
        self.start_timeout = start_timeout
        self.drain_timeout = drain_timeout
        self.kill_timeout = kill_timeout
        self.free_gpus: list[int] | None = list(gpus) if gpus is not None else None
        self._pumps: set[asyncio.Task[None]] = set()

    def command(self, spec: ReplicaSpec) -> list[str]:
        # Port 0: the replica binds a free port itself and reports it on its ready line (no race for the port).
        cmd = [self.python, "-m", "ember_platform.replica", "--registry", spec.registry_url,
               "--reference", spec.reference, "--digest", spec.digest, "--packages-dir", str(self.packages_dir),
               "--blob-cache", str(self.blob_cache), "--host", self.host, "--port", "0",
               "--drain-timeout", str(self.drain_timeout)]
        if spec.registry_endpoint_url:
            cmd += ["--endpoint-url", spec.registry_endpoint_url]
        if self.threads is not None:
            cmd += ["--threads", str(self.threads)]
        if self.redis_url:
            cmd += ["--redis-url", self.redis_url]
        for key, value in spec.overrides.items():
            cmd += ["--override", f"{key}={value}"]
        return cmd

    async def start(self, spec: ReplicaSpec) -> LocalReplica:
        if spec.role != "both":
            raise LaunchError(f"{spec.label}: not supported yet: role {spec.role!r} (the local launcher runs "
                              "replicas that both prefill and decode)")
        gpus = self._take_gpus(spec)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.label}.log"
        cmd = self.command(spec)
        # The secret goes through the environment, never argv (which any local user sees in `ps`).
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1", SECRET_ENV: spec.secret,
               REPLICA_ID_ENV: spec.replica_id}
        if self.free_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        try:
            with open(log_path, "ab") as log:
                log.write(f"$ {' '.join(cmd)}\n".encode())
                log.flush()
                process = await asyncio.create_subprocess_exec(
                    *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=log, env=env,
                    start_new_session=True, preexec_fn=die_with_parent())
        except BaseException:
            self._give_back(gpus)
            raise
        handle = LocalReplica(spec, process, log_path, gpus)
        handle.reader = asyncio.create_task(self._follow(handle), name=f"ember-local-{spec.label}")
        self._pumps.add(handle.reader)
        handle.reader.add_done_callback(self._pumps.discard)
        return handle

    async def status(self, handle: LocalReplica) -> LaunchStatus:
        code = handle.process.returncode
        if handle.failure is not None:
            return LaunchStatus.exited(code, handle.failure)
        if handle.url is None and handle.reader is not None and not handle.reader.done():
            return LaunchStatus.starting()  # its reader says how it ends: ready, or exited with its log's tail
        if code is not None or handle.url is None:
            return LaunchStatus.exited(code, f"replica exited with code {code}")
        return LaunchStatus.running(handle.url)

    async def stop(self, handle: LocalReplica, grace_s: float | None = None) -> None:
        """SIGTERM (the replica drains, then exits), SIGKILL after `grace_s` (default: its drain timeout plus the
        kill timeout); `grace_s=0` kills at once."""
        process = handle.process
        try:
            if process.returncode is not None:
                return
            grace = self.drain_timeout + self.kill_timeout if grace_s is None else grace_s
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
            try:
                await asyncio.wait_for(process.wait(), grace if grace > 0 else self.kill_timeout)
            except TimeoutError:
                logger.warning("replica %s (pid %s) did not exit within %.0f s; killing it", handle.spec.label,
                               process.pid, grace)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), self.kill_timeout)
        finally:
            self._give_back(handle.gpus)
            handle.gpus = ()

    def describe(self, handle: LocalReplica) -> Mapping[str, Any]:
        info: dict[str, Any] = {"launcher": "local", "pid": handle.pid, "log": str(handle.log_path)}
        if handle.gpus:
            info["gpus"] = list(handle.gpus)
        return info

    async def aclose(self) -> None:
        for pump in list(self._pumps):
            pump.cancel()

    # --- internals ----------------------------------------------------------------------------------------

    async def _follow(self, handle: LocalReplica) -> None:
        """Read the replica's stdout: its ready line gives the URL; the rest goes to its log (a full pipe would
        block it). A replica not ready within the start timeout is killed."""
        try:
            handle.url = await asyncio.wait_for(self._read_ready(handle), self.start_timeout)
        except TimeoutError:
            handle.failure = (f"replica of {handle.spec.reference} was not ready within {self.start_timeout:.0f} s"
                              f"{_tail(handle.log_path)}")
            await self.stop(handle, 0)
            return
        except LaunchError as e:
            handle.failure = str(e)
            return
        logger.info("replica %s ready at %s (pid %s, log %s)", handle.spec.label, handle.url, handle.pid,
                    handle.log_path)
        assert handle.process.stdout is not None
        with open(handle.log_path, "ab") as log:
            while raw := await handle.process.stdout.readline():
                log.write(raw)
                log.flush()

    async def _read_ready(self, handle: LocalReplica) -> str:
        stdout = handle.process.stdout
        assert stdout is not None
        while True:
            raw = await stdout.readline()
            if not raw:
                code = await handle.process.wait()
                raise LaunchError(f"replica exited with code {code} before it was ready{_tail(handle.log_path)}")
            line = raw.decode(errors="replace")
            with open(handle.log_path, "a") as log:
                log.write(line)
            if line.startswith(READY_LINE + " "):
                return line.removeprefix(READY_LINE + " ").strip().rstrip("/")

    def _take_gpus(self, spec: ReplicaSpec) -> tuple[int, ...]:
        if self.free_gpus is None or spec.resources.gpus == 0:
            return ()
        if len(self.free_gpus) < spec.resources.gpus:
            raise LaunchError(f"{spec.label}: needs {spec.resources.gpus} GPU(s), {len(self.free_gpus)} of this "
                              "launcher's are free; stop a replica or give the launcher more (gpus option)")
        taken, self.free_gpus = tuple(self.free_gpus[:spec.resources.gpus]), self.free_gpus[spec.resources.gpus:]
        return taken

    def _give_back(self, gpus: tuple[int, ...]) -> None:
        if self.free_gpus is not None and gpus:
            self.free_gpus = sorted({*self.free_gpus, *gpus})


def _tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return ""
    return f"; last lines of {log_path}:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


def build(settings: LaunchSettings) -> LocalProcessLauncher:
    """The factory `ember serve --launcher local` calls. Options (`--launcher-option KEY=VALUE`): threads (torch
    threads per replica), gpus (device indices to hand out, e.g. "0,1,2,3"), start_timeout (seconds),
    packages_dir and blob_cache (where replicas check packages out)."""
    unknown = sorted(set(settings.options) - set(OPTIONS))
    if unknown:
        raise LaunchError(f"launcher 'local': unknown option(s) {', '.join(unknown)} (known: {', '.join(OPTIONS)})")
    options = settings.options
    try:
        threads = int(options["threads"]) if "threads" in options else None
        gpus = [int(g) for g in options["gpus"].split(",") if g.strip()] if "gpus" in options else None
        start_timeout = float(options.get("start_timeout", 300.0))
    except ValueError as e:
        raise LaunchError(f"launcher 'local': bad option value: {e}") from None
    return LocalProcessLauncher(log_dir=settings.home / "logs", host=settings.host, redis_url=settings.redis_url,
                                drain_timeout=settings.drain_timeout_s, threads=threads, gpus=gpus,
                                start_timeout=start_timeout,
                                packages_dir=Path(options["packages_dir"]) if "packages_dir" in options else None,
                                # the control plane's cache under `ember serve` ($EMBER_CACHE, else ~/.ember/cache)
                                blob_cache=Path(options.get("blob_cache") or BlobCache.default().root))
