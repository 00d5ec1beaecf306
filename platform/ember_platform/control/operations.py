"""Deploy operations: deploy, promote, rollback, delete. Each takes its deployment's lock, so they happen one at a
time; a new version's replicas start and become ready before the previous version's drain, so no request is
dropped, and an operation that fails changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from ember.manifest import load_manifest
from ember.registry import checkout, parse_reference, short_digest
from ember_platform.control.core import PlaneCore, logger
from ember_platform.control.deployments import Deployment, DeploymentVersion, PullRecord, Replica
from ember_platform.control.errors import Conflict, DeployError, InvalidDeployment, VersionNotFound


class DeployOperations(PlaneCore):
    """The control plane's operations on deployments (the admin API's POST and DELETE)."""

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
            if overrides:  # refused now (400) rather than by replicas that then fail to start
                await asyncio.to_thread(check_overrides, pulled, overrides)
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

    def _pull(self, reference: str) -> DeploymentVersion:
        """Resolve, then pull once into packages/<name>/<version>/ through the blob cache (runs in a thread)."""
        out = checkout(self.registry, reference, self.packages_dir, self.cache)
        pulled = out.pull
        record = PullRecord(out.resolve_s, out.pull_s, pulled.downloaded_bytes if pulled else 0,
                            len(pulled.downloaded) if pulled else 0,
                            pulled.from_cache if pulled else len(out.lock.blobs()), reused=pulled is None)
        manifest = load_manifest(out.path)
        logger.info("pulled %s (%s) into %s in %.2f s", out.lock.reference, short_digest(out.lock.digest), out.path,
                    record.resolve_s + record.pull_s)
        return DeploymentVersion(out.lock.version, out.lock.digest, out.path, manifest, record)

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


def check_overrides(version: DeploymentVersion, overrides: Mapping[str, str]) -> None:
    """InvalidDeployment for overrides a replica of `version` would refuse (an unknown key, a value its manifest
    section does not take, a setting not supported yet, an option no technique reads): the replica's own checks,
    run here before any replica starts. Torch-free, like the replica's command-line check."""
    from ember.errors import EmberError
    from ember.plugins import PluginHost
    from ember_platform.engine.config import override_value, resolve_source

    where = f"{version.manifest.reference} with overrides {dict(overrides)}"
    try:
        source, _ = resolve_source(version.package_dir, {k: override_value(v) for k, v in overrides.items()})
        PluginHost.for_package(version.package_dir).check_manifest(source.manifest, source=where)
    except (EmberError, TypeError, ValueError) as e:
        raise InvalidDeployment(f"cannot deploy {where}: {e}") from None
